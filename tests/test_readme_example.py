"""The README's example runs as written, so the README cannot drift from the API.

Its fenced block (the one after ``<!-- example: kv_example.py -->``) is saved as kv_example.py and
run as two real processes, ``decode`` and ``prefill``, on a free port. Then: the decode's blocks
0, 1, 2 hold the prefill's blocks 3, 4, 9 byte for byte in every layer and K/V, every other
decode byte still holds the poison its allocator left, the pair took the shared-memory path
(``local``), ``wait()`` returned DONE, and both printed what the README says they print.

Run again with plain ``torch.empty`` caches in place of ``shared_empty`` (the README says what
that prints): the pair goes over ``ucx``, the route printed starts as the README says, the
prefill logs exactly one slow-route warning naming the fix, and the bytes land the same.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- example: kv_example.py -->"
STORE = "tcp://127.0.0.1:29600"
POISON = 0xA5
SRC, DST = [3, 4, 9], [0, 1, 2]

# Runs the example unchanged, with its allocator's uninitialised bytes made a known poison (and,
# for "plain", plain torch.empty memory in place of shared memory), and keeps what it left behind
# for the checks.
HARNESS = textwrap.dedent("""
    import runpy, sys, torch, xfer

    real = xfer.shared_empty if sys.argv[2] == "shared" else torch.empty
    def poisoned_empty(*args, **kwargs):
        t = real(*args, **kwargs)
        t.view(torch.uint8).fill_({poison})
        return t
    xfer.shared_empty = poisoned_empty
    sys.argv = ["kv_example.py", sys.argv[1]]
    ns = runpy.run_path("kv_example.py", run_name="__main__")
    route, t = ns.get("route"), ns.get("t")
    torch.save({{"caches": [c.clone() for c in ns["caches"]],
                 "route": None if route is None else route.kind.value,
                 "state": None if t is None else t.poll().name}}, sys.argv[1] + ".pt")
""").format(poison=POISON)


def example_code() -> str:
    text = README.read_text()
    assert text.count(MARKER) == 1, f"README.md must hold one {MARKER!r}"
    block = re.compile(r"```python\n(.*?)```", re.S).search(text, text.index(MARKER))
    assert block is not None, f"no ```python block after {MARKER!r}"
    return block.group(1)


def claimed_output() -> tuple[str, str, str]:
    """What the README says the prefill (route, then state) and the decode print."""
    text = " ".join(README.read_text().split())
    m = re.search(r"The prefill prints `([^`]*)` and `([^`]*)`; the decode prints `([^`]*)`", text)
    assert m is not None, "README.md no longer says what the example prints"
    return m.group(1), m.group(2), m.group(3)


def claimed_plain_route() -> str:
    """How the README says the route printed with plain caches begins (up to its ``...``)."""
    text = " ".join(README.read_text().split())
    m = re.search(r"the route prints `(ucx \(local refused: [^`]*?)\.\.\.\)`", text)
    assert m is not None, "README.md no longer says what the route of plain caches prints"
    return m.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(role: str, memory: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    return subprocess.Popen([sys.executable, "harness.py", role, memory], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args[-1]} did not finish in {timeout} s; stderr:\n{err[-3000:]}") from None
    return proc.returncode, out, err


@pytest.mark.parametrize("memory", [
    "shared",
    pytest.param("plain", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                                                   reason="plain caches go over ucx: pip install -e '.[ucx]'")),
])
def test_readme_example_runs_as_written(tmp_path, memory):
    code = example_code()
    assert code.count(STORE) == 1, f"the example should open its store at {STORE}"
    (tmp_path / "kv_example.py").write_text(code.replace(STORE, f"tcp://127.0.0.1:{_free_port()}"))
    (tmp_path / "harness.py").write_text(HARNESS)

    decode = _start("decode", memory, tmp_path)
    prefill = _start("prefill", memory, tmp_path)
    try:
        prc, pout, perr = _finish(prefill, 60)
        drc, dout, derr = _finish(decode, 60)
    finally:
        for p in (prefill, decode):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert prc == 0, perr[-3000:]
    assert drc == 0, derr[-3000:]

    route_line, state_line, note_line = claimed_output()
    assert dout.splitlines() == [note_line]
    src, dst = torch.load(tmp_path / "prefill.pt"), torch.load(tmp_path / "decode.pt")
    warned = [line for line in perr.splitlines() if "slow route" in line]
    if memory == "shared":
        assert pout.splitlines() == [route_line, state_line]
        assert src["route"] == "local", "two processes on one host with shared_empty caches take the local path"
        assert warned == []
    else:
        printed, state = pout.splitlines()
        assert printed.startswith(claimed_plain_route()) and state == state_line, printed
        assert src["route"] == "ucx"
        assert len(warned) == 1, perr[-3000:]
        assert "prefill-0:kv -> decode-0:kv goes over ucx" in warned[0] and "xfer.shared_empty" in warned[0]
    assert src["state"] == "DONE"
    others = [b for b in range(dst["caches"][0].shape[1]) if b not in DST]
    for layer, (s, d) in enumerate(zip(src["caches"], dst["caches"], strict=True)):
        s, d = s.view(torch.uint8), d.view(torch.uint8)  # (2, blocks, block_size, heads, head_dim * 2 bytes)
        assert torch.equal(d[:, DST], s[:, SRC]), f"layer {layer}: destination blocks differ from the source"
        assert (s[:, SRC] != POISON).any(), f"layer {layer}: the source was never written"
        assert bool((d[:, others] == POISON).all()), f"layer {layer}: a block outside {DST} changed"
