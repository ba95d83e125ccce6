"""TrainWorker: one Ray actor per GPU (or CPU slot) running the trainer of one rank.

The trainer runs in a thread of the actor, so the actor's own methods (``poll``, ``stacks``,
``request_stop``) answer while the trainer computes or is stuck in a collective; that is what
lets the coordinator watch progress, dump stacks of a hung rank and stop gracefully.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import ray

from hpservice.launch import free_port, socket_interface

from .failure_policy import WorkerAddress, WorkerPoll


@ray.remote
class TrainWorker:
    def __init__(self, job_id: str, rank: int, world_size: int, coordinator):
        """``coordinator``: the handle of the coordinator that started this worker; its reports go
        there, never to whatever actor holds the coordinator's name later."""
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self._coordinator = coordinator
        self._thread: threading.Thread | None = None
        self._trainer = None
        self._error: str | None = None
        self._config_error = False
        self._done = False
        self._step = 0
        self._last_progress = time.time()
        self._stop = threading.Event()

    # ---- placement and rendezvous -----------------------------------------------------------
    def address(self) -> WorkerAddress:
        """Where this rank runs; rank 0's is the rendezvous address."""
        node_id = ray.get_runtime_context().get_node_id()
        return WorkerAddress(self.rank, ray.util.get_node_ip_address(), free_port(host=""), os.getpid(), node_id)

    def start(self, spec, master_addr: str, master_port: int, reported_up_to: int = 0) -> None:
        """Run the attempt's spec (a JobSpec) as the coordinator resolved it (GPUs, resume
        point, size), without deciding any of it again. ``reported_up_to``: the last step whose
        metrics the coordinator has (the trainer reports earlier attempts' steps after it)."""
        if spec.training.compile:
            from hpservice.train._compile import isolate_compile_cache

            isolate_compile_cache(spec.run_dir())
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray shows each worker only its own GPU
            LOCAL_WORLD_SIZE="1",
        )
        # gloo (CPU jobs, and GPU jobs' checkpoint group) on the interface peers reach this node at
        interface = socket_interface(ray.util.get_node_ip_address())
        if interface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
        self._thread = threading.Thread(target=self._run, args=(spec, reported_up_to), name=f"trainer-rank{self.rank}", daemon=True)
        self._thread.start()

    def _run(self, spec, reported_up_to: int) -> None:
        from hpservice.checkpoint import CheckpointStorageError, UnsafeCheckpointError
        from hpservice.inputs import InputError
        from hpservice.spec import SpecError
        from hpservice.train import Trainer, TrainingError
        from hpservice.train._storage import StorageLimitError

        try:
            self._trainer = Trainer(
                spec,
                on_metrics=self._on_metrics,
                on_checkpoint=lambda info: self._coordinator.record_checkpoint.remote(info),
                log_fn=self._log,
                reported_up_to=reported_up_to,
            )
            if self._stop.is_set():
                self._trainer.request_stop()
            self._trainer.train()
        except BaseException as e:
            self._error = traceback.format_exc()
            # Refused while being built from the spec, checkpoints the storage cannot hold, input
            # files refused (outside the roots, or crafted), or past the job's storage budget: the
            # same spec would fail the same way.
            built = self._trainer is not None
            limits = CheckpointStorageError | UnsafeCheckpointError | InputError | StorageLimitError
            self._config_error = isinstance(e, limits) or (
                not built and isinstance(e, TrainingError | SpecError)
            )
            self._log(self._error)
        finally:
            self._done = True

    def _on_metrics(self, record: dict) -> None:
        self._coordinator.report.remote(record)

    def _log(self, line: str) -> None:
        print(f"[rank {self.rank}] {line}", flush=True)
        step = self._trainer.step if self._trainer is not None else 0
        self._coordinator.add_log.remote(self.rank, step, line)

    # ---- observed by the coordinator ---------------------------------------------------------
    def poll(self) -> WorkerPoll:
        step = self._trainer.step if self._trainer is not None else 0
        if step != self._step:
            self._step, self._last_progress = step, time.time()
        return WorkerPoll(self.rank, step, self._done, self._last_progress, self._error, self._config_error)

    def request_stop(self) -> None:
        self._stop.set()
        if self._trainer is not None:
            self._trainer.request_stop()

    def stacks(self) -> str:
        """Python stacks of every thread of this worker (for hang reports)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = []
        for ident, frame in sys._current_frames().items():
            parts.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
        return "\n".join(parts)
