"""The ``hpservice`` command line."""

from __future__ import annotations

import argparse
import sys

# Subcommands of the product that later issues build; they say so instead of pretending.
_NOT_BUILT = {
    "submit": "submitting a job to the service (control-plane issue)",
    "serve": "the REST control plane (control-plane issue)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpservice", description="Distributed training service.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the DTensor core demo on local gloo ranks")
    demo.add_argument("--ranks", type=int, default=4, help="number of local ranks (even, >= 2)")
    sub.add_parser("version", help="print the version")
    run = sub.add_parser("run", help="run a job on a local Ray (or --address) with a live progress bar")
    run.add_argument("job")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    run.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    validate = sub.add_parser("validate", help="check a job file; print its errors with field paths")
    validate.add_argument("job")
    validate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    sub.add_parser("schema", help="print the job spec's JSON Schema (for editor completion)")
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
    if args.command == "run":
        from hpservice.spec import SpecError, load_job

        try:
            spec = load_job(args.job, args.set)
        except SpecError as e:
            print(e, file=sys.stderr)
            return 2
        from hpservice.run_local import run_job

        return run_job(spec, address=args.address)
    if args.command == "validate":
        from hpservice.spec import SpecError, load_job

        try:
            spec = load_job(args.job, args.set)
        except SpecError as e:
            print(e, file=sys.stderr)
            return 1
        print(
            f"{args.job}: valid job {spec.name!r} ({spec.model.name}/{spec.model.flavor}, {spec.training.steps} steps)"
        )
        return 0
    if args.command == "schema":
        import json

        from hpservice.spec import JobSpec

        print(json.dumps(JobSpec.model_json_schema(by_alias=True), indent=2))
        return 0
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
