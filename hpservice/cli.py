"""The ``hpservice`` command line."""

from __future__ import annotations

import argparse
import sys

# Subcommands of the product that later issues build; they say so instead of pretending.
_NOT_BUILT = {
    "run": "running a job locally (training runtime and Ray actor issues)",
    "submit": "submitting a job to the service (control-plane issue)",
    "serve": "the REST control plane (control-plane issue)",
    "validate": "job spec validation (training-runtime issue)",
    "schema": "the job spec JSON Schema (training-runtime issue)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpservice", description="Distributed training service.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the DTensor core demo on local gloo ranks")
    demo.add_argument("--ranks", type=int, default=4, help="number of local ranks (even, >= 2)")
    sub.add_parser("version", help="print the version")
    export = sub.add_parser("export", help="write a sharded checkpoint's full model weights to a .safetensors file")
    export.add_argument("checkpoint", help="a committed checkpoint directory (step-N)")
    export.add_argument("out", help="output .safetensors path")
    for name, what in _NOT_BUILT.items():
        p = sub.add_parser(name, help=f"not built yet: {what}")
        p.add_argument("args", nargs="*")
    args = parser.parse_args(argv)

    if args.command == "version":
        from hpservice import __version__

        print(__version__)
        return 0
    if args.command == "demo":
        from hpservice.demo import run_demo

        return run_demo(args.ranks)
    if args.command == "export":
        from hpservice.checkpoint import CheckpointError, export_safetensors

        try:
            shapes = export_safetensors(args.checkpoint, args.out)
        except (CheckpointError, FileNotFoundError) as e:
            print(f"hpservice export: {e}", file=sys.stderr)
            return 1
        print(f"wrote {len(shapes)} tensors to {args.out}")
        return 0
    print(f"hpservice {args.command}: not built yet ({_NOT_BUILT[args.command]})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
