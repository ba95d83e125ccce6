"""The package layout pyproject declares: every package folder is listed, the layers install under
the hpservice namespace, and a built wheel has no top-level `api` or `actors`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_declared_under_the_hpservice_namespace():
    config = _config()
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == set(config["packages"])
    assert all(p == "hpservice" or p.startswith("hpservice.") for p in config["packages"])


def test_the_wheel_installs_the_layers_as_hpservice_api_and_actors(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("hpservice-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "api" not in tops and "actors" not in tops
    # the page and every ES module it imports (no build step: the wheel carries them as they are)
    assert {f"hpservice/api/static/{f}" for f in ("index.html", "app.js", "api.js", "chart.js", "format.js", "stream.js")} <= set(names)
    assert "hpservice/actors/coordinator.py" in names
    assert "hpservice/api/routes/jobs.py" in names
    assert "hpservice/api/migrations/env.py" in names  # the schema migrations, every revision
    assert {
        "hpservice/api/migrations/versions/0001_baseline.py",
        "hpservice/api/migrations/versions/0003_64_bit_steps.py",
    } <= set(names)


def test_importing_the_trainer_does_not_load_torch_compile():
    """Every training process (Ray worker, rank, CLI) imports the trainer: loading dynamo with it
    would cost each about a second of CPU before any work (hpservice._graph_break)."""
    code = "import sys, hpservice.train, hpservice.models, hpservice.parallel; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"
