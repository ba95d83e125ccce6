"""The `hpservice` command: demo rows are real checks; unbuilt commands say so."""

import subprocess
import sys

import pytest

from hpservice import __version__
from hpservice.cli import main
from hpservice.demo import _tour


def test_demo_tour_matches_single_device(ranks):
    rows = ranks(4).run(_tour, (2, 2))[0]
    assert len(rows) == 6
    assert all(ok for *_, ok in rows), rows
    assert rows[1][2] == "AllToAll -> Slice"  # (S0, R) -> (S1, S0)


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == __version__
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hpservice {__version__}"


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "hpservice", "version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == __version__


def test_every_subcommand_explains_itself_and_each_argument():
    """``hpservice X -h`` says what X does and what each argument is, for every X."""
    import argparse

    from hpservice.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert command.description, f"hpservice {name} -h has no description"
        unexplained = [a.dest for a in command._actions if not a.help]
        assert not unexplained, f"hpservice {name}: arguments without help: {unexplained}"
