"""xfer's layers and the absence of import cycles, as import-linter contracts (.importlinter).

pyproject maps three folders into the package (kernels/ -> xfer.kernels, engine/ -> xfer.engine,
bench/ -> xfer.bench), which the import graph only sees where the package is laid out as
installed: these tests copy the sources that way into a temporary directory and run import-linter's
``lint-imports`` there. ``python tests/test_layers.py`` prints its report.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="the layer contracts need import-linter: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"
MAPPED = ("kernels", "engine", "bench")  # folders pyproject maps into xfer


def lay_out(where: Path) -> Path:
    """The package as installed, under ``where``: xfer/ with the mapped folders inside it."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "results", "examples", "*.json", "*.md")
    shutil.copytree(ROOT / "xfer", where / "xfer", ignore=skip)
    for name in MAPPED:
        shutil.copytree(ROOT / name, where / "xfer" / name, ignore=skip)
    return where


def lint(where: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the copy under ``where`` (its working directory, first on its path)."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, str(CONFIG)], cwd=where, capture_output=True, text=True,
                          timeout=120)


def test_the_layer_contracts_hold(tmp_path):
    run = lint(lay_out(tmp_path))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout and "Contracts: 4 kept" in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("module, line, broken", [
    # kernels reaching up into the transports (the hidden cycle the layering forbids)
    ("kernels/_dispatch.py", "from xfer.transports import TransportKind", "xfer's layers"),
    # a transport package reaching into a sibling transport
    ("xfer/transports/ucx/wire.py", "from ..nvshmem import proto", "transports:"),
    # core reaching up into the agent, inside a function
    ("xfer/layout.py", "def _late():\n    from xfer import agent", "xfer's layers"),
    # a cycle between two sibling modules of the bench
    ("bench/agents.py", "from .sweep import Plan", "no import cycles"),
])
def test_an_upward_import_or_a_cycle_breaks_a_contract(tmp_path, module, line, broken):
    """The contracts can fail: one import added where the design forbids it breaks the one that says so."""
    where = lay_out(tmp_path)
    target = where / "xfer" / module.split("/", 1)[1] if module.startswith("xfer/") else where / "xfer" / module
    target.write_text(target.read_text() + "\n\n" + line + "\n")
    run = lint(where)
    assert run.returncode != 0, f"adding {line!r} to {module} broke no contract:\n{run.stdout[-2000:]}"
    section = run.stdout[run.stdout.index("Broken contracts"):]
    assert broken in section, section[:3000]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = lint(lay_out(Path(tmp)))
        print(out.stdout, out.stderr, sep="")
        sys.exit(out.returncode)
