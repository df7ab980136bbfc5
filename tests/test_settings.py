"""The settings table (xfer/settings.py): every knob declared once, parsed once, documented.

docs/settings.md must be what the table renders; every ``XFER_*`` name the code mentions must be
a declared knob; library code (xfer/, kernels/) reads none of them outside xfer/settings.py."""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import fields
from pathlib import Path

import pytest

from xfer import AgentConfig
from xfer.errors import InvalidArgumentError
from xfer.settings import KNOBS, Settings, UcxSettings, render_markdown

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"XFER_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])")  # a trailing "_" is a prefix (XFER_UCX_*), not a variable


def _strings(path: Path):
    """Every string literal of a Python file (docstrings and f-strings included), with its line."""
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)):
                yield tok.start[0], tok.string


def _code_files():
    for top in ("xfer", "kernels", "engine", "bench"):
        yield from (p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_docs_settings_md_is_generated_from_the_table():
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert doc == render_markdown(), "docs/settings.md is stale: run `python -m xfer.settings > docs/settings.md`"


def test_every_xfer_variable_the_code_names_is_a_declared_knob():
    declared = {k.env for k in KNOBS}
    assert len(declared) == len(KNOBS), "a variable is declared twice"
    unknown = sorted({f"{p.relative_to(ROOT)}:{line}: {name}" for p in _code_files() for line, text in _strings(p)
                      for name in NAME.findall(text) if name not in declared})
    assert not unknown, "XFER_* variables not in xfer/settings.py's KNOBS:\n" + "\n".join(unknown)


# where library code may touch the environment outside xfer/settings.py: other programs' variables
# (xfer.settings.FOREIGN), at set-up only
FOREIGN_READ = re.compile(r"UCX_WARN_UNUSED_ENV_VARS|PYTORCH_(CUDA_)?ALLOC_CONF|CUDA_VISIBLE_DEVICES|NVSHMEM_|VMM_ENV"
                          r"|heap_choice")


def _env_touches(top: str):
    for p in sorted((ROOT / top).rglob("*.py")):
        if p == ROOT / "xfer" / "settings.py" or "__pycache__" in p.parts:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\benviron\b|getenv\(", line):
                yield f"{p.relative_to(ROOT)}:{n}: {line.strip()}"


def test_library_code_reads_the_environment_only_in_settings():
    """xfer/ and kernels/ touch ``os.environ`` only in xfer/settings.py, but for other programs'
    variables at set-up (UCX's, torch's allocator, CUDA's, NVSHMEM's)."""
    offenders = [t for top in ("xfer", "kernels") for t in _env_touches(top) if not FOREIGN_READ.search(t)]
    assert not offenders, "read XFER_* settings through xfer.settings:\n" + "\n".join(offenders)


def test_the_scans_can_fail(tmp_path):
    """The scans above see a read they must refuse (a test that cannot fail is a defect)."""
    bad = tmp_path / "bad.py"
    bad.write_text('import os\nX = os.environ.get("XFER_NOT_A_KNOB", "1")\n')
    assert [NAME.findall(t) for _, t in _strings(bad) if NAME.findall(t)] == [["XFER_NOT_A_KNOB"]]
    assert "XFER_NOT_A_KNOB" not in {k.env for k in KNOBS}
    assert not FOREIGN_READ.search(bad.read_text().splitlines()[1])  # and the read is not a foreign one


def test_defaults_match_the_dataclasses_and_parse_from_the_environment():
    for k in KNOBS:
        if k.group == "bench":
            continue
        owner = Settings if k.group == "agent" else type(getattr(Settings(), k.group))
        defaults = {f.name: f.default for f in fields(owner)}
        assert k.field in defaults and defaults[k.field] == k.default, k.env
    env = {"XFER_UCX_CHUNK_BYTES": "64K", "XFER_UCX_IOV": "off", "XFER_UCX_KEEPALIVE_S": "2.5",
           "XFER_SGLANG_TRANSPORTS": "local, ucx", "XFER_COPY_PATH": "batch", "XFER_SECRET": "s" * 16,
           "XFER_LAUNCH_INLINE": "0", "XFER_UCX_MIN_CHUNKS": "8", "XFER_UCX_ADDRESS": ""}
    s = Settings.from_env(env)
    assert (s.ucx.chunk_bytes, s.ucx.iov, s.ucx.keepalive_s, s.ucx.min_chunks, s.ucx.address) == \
        (64 << 10, False, 2.5, 8, None)
    assert s.sglang.transports == ("local", "ucx") and s.copy.path == "batch" and s.secret == "s" * 16
    assert s.onesided.launch_inline is False and "secret" not in repr(s)
    assert Settings.from_env({}) == Settings()
    for env, match in (({"XFER_UCX_DEPTH": "four"}, "XFER_UCX_DEPTH must be an integer"),
                       ({"XFER_UCX_KEEPALIVE_S": "soon"}, "XFER_UCX_KEEPALIVE_S must be a number"),
                       ({"XFER_UCX_SLOTS": "1"}, "slots must be an int >= 2"),
                       ({"XFER_UCX_MIN_CHUNKS": "0"}, "min_chunks must be an int >= 1")):
        with pytest.raises(InvalidArgumentError, match=match):
            Settings.from_env(env)


def test_an_agent_config_reads_the_environment_once_when_made(monkeypatch):
    monkeypatch.setenv("XFER_UCX_DEPTH", "7")
    config = AgentConfig()
    monkeypatch.setenv("XFER_UCX_DEPTH", "9")
    assert config.settings.ucx.depth == 7 and AgentConfig().settings.ucx.depth == 9
    mine = Settings(ucx=UcxSettings(depth=3))
    assert AgentConfig(settings=mine).settings is mine
    with pytest.raises(InvalidArgumentError, match="settings must be an xfer.settings.Settings"):
        AgentConfig(settings={"ucx": {}})
    assert io.StringIO(render_markdown()).readline().startswith("# Settings")
