"""The ``hpservice`` command line, one module per group of commands:

- ``local``: ``demo``, ``version``, ``run``, ``validate``, ``schema``, ``export``, ``prepare-data``,
  ``generate``: this machine.
- ``server``: ``serve``: the control plane.
- ``service``: ``submit``, ``list``, ``status``, ``watch``, ``logs``, ``cancel``, ``checkpoints``,
  ``artifacts``, ``resubmit``, ``delete``: a running control plane, over HTTP.

Each module adds its parsers and sets each one's handler (``run``); ``main`` calls it: one way of
dispatching. Exit codes: ``hpservice.jobs.ExitCode`` (``hpservice --help`` lists them).
"""

from __future__ import annotations

import argparse

from hpservice.jobs import EXIT_CODES_HELP

from . import local, server, service


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Each subcommand's ``-h`` opens with its one-line help (its
    ``description``, unless it has a longer one) and explains every argument."""
    from hpservice import __version__

    parser = argparse.ArgumentParser(
        prog="hpservice",
        description="Distributed training service.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hpservice {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    local.add_parsers(sub)
    server.add_parsers(sub)
    service.add_parsers(sub)
    for choice in sub._choices_actions:  # argparse keeps each subcommand's help only for the listing
        command = sub.choices[choice.dest]
        if command.description is None:
            command.description = choice.help[:1].upper() + choice.help[1:] + "."
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    import sys

    sys.exit(main())
