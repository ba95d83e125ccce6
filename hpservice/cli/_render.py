"""How the CLI draws a job with rich: the end-of-run summary and the placement line (the numbers
come from ``hpservice.jobs``; ``hpservice run`` and the service commands print the same)."""

from __future__ import annotations

from hpservice.jobs import JobState, steady_state

__all__ = ["describe_placement", "print_summary"]

_STYLE = {JobState.SUCCEEDED: "green", JobState.FAILED: "red", JobState.CANCELLED: "yellow"}


def print_summary(console, job: dict, records: list[dict]) -> None:
    """The end-of-run summary of ``hpservice run`` and ``hpservice watch``: final state and
    message, steps, final loss, steady-state tokens/s (and MFU), restarts, latest checkpoint.
    ``job`` is a ``JobOut`` or a coordinator status (the same keys); ``records`` the metrics seen."""
    from rich.text import Text

    state = job["state"]
    line = Text(str(state), style=_STYLE.get(state, "bold"))
    if job.get("message"):
        line.append(f": {job['message']}")
    console.print(line)
    last = records[-1] if records else {}
    parts = [f"step {last.get('step', job.get('step', 0))}/{job.get('total_steps', '?')}"]
    if isinstance(last.get("loss"), int | float):
        parts.append(f"final loss {last['loss']:.4f}")
    steady = steady_state(records)
    if steady:
        rate = f"{steady['tokens_per_s']:,.0f} tok/s steady (mean over the last {steady['steps']} steps)"
        parts.append(rate + (f", MFU {steady['mfu']:.1%}" if "mfu" in steady else ""))
    console.print(Text("  " + ", ".join(parts)))
    if isinstance(last.get("expert_load"), dict):  # a mixture-of-experts job: each layer's balance
        loads = last["expert_load"]
        worst = max(loads, key=lambda layer: max(loads[layer]) / max(sum(loads[layer]) / len(loads[layer]), 1e-9))
        row = loads[worst]
        console.print(Text(
            f"  expert load at the last step: {len(loads)} MoE layers; the most imbalanced, layer {worst}, "
            f"from {min(row):,.0f} to {max(row):,.0f} tokens per expert ({last.get('expert_imbalance', 0):.2f}x the mean)"
        ))  # fmt: skip
    if job.get("restarts"):
        console.print(Text(f"  restarts: {job['restarts']} ({'; '.join(job.get('restart_reasons') or [])})"))
    if job.get("checkpoints"):
        console.print(Text(f"  latest checkpoint: {job['checkpoints'][-1].get('path')}"))


def describe_placement(placement: list[dict]) -> str:
    """A job's rank -> node map in one line: ``node 3026f34c (10.0.0.2): ranks 0, 1; node ...``."""
    by_node: dict[str, list[int]] = {}
    for p in placement:
        by_node.setdefault(p["node"], []).append(p["rank"])
    return "; ".join(
        f"{node}: {'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))}" for node, ranks in by_node.items()
    )
