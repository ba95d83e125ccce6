"""``python -m hpservice.bench <benchmark> [options]``; ``--help`` lists the benchmarks."""

from __future__ import annotations

import argparse
import sys

from hpservice.bench import (
    ac,
    checkpoint,
    cp,
    dpo,
    fsdp,
    gpu,
    hf,
    lora,
    memory,
    moe,
    overhead,
    plan,
    redistribute,
    scheduler,
    service,
    sft,
    tp,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpservice.bench",
        description="Benchmarks of hpservice against torch (local gloo ranks) and Ray Train (local Ray).",
    )
    sub = parser.add_subparsers(dest="benchmark", required=True)
    redistribute.add_parser(sub)
    ac.add_parser(sub)
    checkpoint.add_parser(sub)
    cp.add_parser(sub)
    fsdp.add_parser(sub)
    service.add_parser(sub)
    tp.add_parser(sub)
    memory.add_parser(sub)
    hf.add_parser(sub)
    gpu.add_parser(sub)
    overhead.add_parser(sub)
    plan.add_parser(sub)
    moe.add_parser(sub)
    scheduler.add_parser(sub)
    sft.add_parser(sub)
    lora.add_parser(sub)
    dpo.add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
