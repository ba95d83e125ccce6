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
