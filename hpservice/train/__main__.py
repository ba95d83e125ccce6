"""torchrun --nproc-per-node N -m hpservice.train job.yaml [--set key=value ...]"""

import argparse
import logging
import sys

from hpservice.spec import SpecError, load_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpservice.train", description="Run a job's trainer (under torchrun)."
    )
    parser.add_argument("job", help="job YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        spec = load_job(args.job, args.set)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 2
    from hpservice.train import Trainer

    Trainer(spec).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
