"""The cluster's nodes as a coordinator sees them: which are alive, and which were lost.

Ray marks a node dead only after its health checks miss for a while (about 15 s by default),
but the workers on a node whose raylet was killed die at once: a coordinator that replaced them
straight away would place the new ones on the dead node's still-reserved resources and burn a
restart. So a node counts as lost as soon as its raylet stops accepting connections, and new
workers are placed only after Ray has marked it dead.
"""

from __future__ import annotations

import socket
import time

import ray

HEAD_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource


def nodes() -> dict[str, dict]:
    """Every node Ray knows, by node id."""
    return {n["NodeID"]: n for n in ray.nodes()}


def alive_resources() -> list[dict]:
    """The total resources of each live node."""
    return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]


def _raylet_answers(node: dict, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s):
            return True
    except OSError:
        return False


def lost(node_ids) -> list[str]:
    """Those of ``node_ids`` that are dead or whose raylet no longer answers."""
    known = nodes()
    return [
        i for i in dict.fromkeys(node_ids) if i not in known or not known[i]["Alive"] or not _raylet_answers(known[i])
    ]


def wait_marked_dead(node_ids, timeout_s: float) -> bool:
    """Wait until Ray itself has marked every one of ``node_ids`` dead (so nothing is placed there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        known = nodes()
        if all(not known.get(i, {}).get("Alive") for i in node_ids):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def describe(node_id: str, known: dict | None = None) -> str:
    """``node 3026f34c (192.0.2.2)``: the short id and the address, for messages."""
    node = (known if known is not None else nodes()).get(node_id, {})
    ip = node.get("NodeManagerAddress")
    return f"node {node_id[:8]}" + (f" ({ip})" if ip else "")
