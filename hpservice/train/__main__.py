"""torchrun --nproc-per-node N -m hpservice.train job.yaml [--set key=value ...]"""

import argparse
import logging
import sys

from hpservice.jobs import ExitCode
from hpservice.spec import SpecError, load_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpservice.train", description="Run a job's trainer (under torchrun)."
    )
    parser.add_argument("job", help="job YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from hpservice.preflight import check_devices, check_inputs, check_model, raise_if

    try:
        spec = load_job(args.job, args.set)
        # torchrun gives the world size, so the layout is checked at start; the rest is knowable now
        raise_if(check_model(spec) + check_inputs(spec) + check_devices(spec), args.job)
        # every rank plans alike (the same inputs, no time budget): auto's layout, and the estimate
        # reported beside each step's peaks in place of whatever the file says
        spec = _plan(spec)
    except SpecError as e:
        print(e, file=sys.stderr)
        return ExitCode.USAGE
    from hpservice.train import Trainer

    trainer = Trainer(spec)
    if trainer.rank == 0:  # where this run's outputs are: its id is decided in Trainer (rank 0's, for all)
        checkpoints = f", checkpoints in {trainer.spec.checkpoint.dir}" if trainer.checkpoints is not None else ""
        print(f"[{spec.name}] run {trainer.spec.run_id}: metrics in {trainer.output_dir}{checkpoints}", flush=True)
    trainer.train()
    return ExitCode.OK


def _plan(spec):
    """The memory plan under torchrun (``parallelism: auto`` included): the world it gave, this
    machine's devices."""
    import os

    import torch

    from hpservice.preflight import plan_memory

    world = int(os.environ.get("WORLD_SIZE", "1"))
    spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"workers": world})})
    cuda = torch.cuda.is_available()
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else None
    return plan_memory(spec, device_memory=memory, device="cuda" if cuda else "cpu", source="this GPU's memory", budget_s=None)


if __name__ == "__main__":
    sys.exit(main())
