"""xfer's SGLang transfer backend with SGLang's real base classes (opt-in: needs SGLang installed,
see README.md, "Running the engine tests"). The harness replays SGLang's call order: bootstrap server, managers
(prefill registers to bootstrap), receiver ``init`` / ``send_metadata``, sender ``init`` / chunked
``send``, both polled to ``KVPoll.Success``; decode pages and aux rows are checked byte for byte."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (opt-in engine tests: see the README section Running the engine tests)")
conn = pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="SGLang's disaggregation base is missing")

from dropin_harness import run_sglang_failure, run_sglang_pd  # noqa: E402

sglang_conn = pytest.importorskip("xfer.engine.sglang_conn")
pytestmark = pytest.mark.timeout(120)


def test_classes_implement_sglang_bases():
    assert issubclass(sglang_conn.XferKVManager, conn.BaseKVManager)
    assert issubclass(sglang_conn.XferKVSender, conn.BaseKVSender)
    assert issubclass(sglang_conn.XferKVReceiver, conn.BaseKVReceiver)
    assert issubclass(sglang_conn.XferKVBootstrapServer, conn.BaseKVBootstrapServer)
    for cls in (sglang_conn.XferKVManager, sglang_conn.XferKVSender, sglang_conn.XferKVReceiver):
        assert not getattr(cls, "__abstractmethods__", None), f"{cls.__name__} leaves {cls.__abstractmethods__}"


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_prefill_to_decode(p_tp, d_tp):
    run_sglang_pd(sglang_conn, conn.KVArgs, conn.KVPoll, p_tp=p_tp, d_tp=d_tp, total_heads=2)


def test_mla():
    run_sglang_pd(sglang_conn, conn.KVArgs, conn.KVPoll, mla=True, total_heads=1, dim=576)


def test_failure_is_reported():
    run_sglang_failure(sglang_conn, conn.KVArgs, conn.KVPoll)


def test_hook_replaces_backend_in_sglang():
    try:
        importlib.import_module("sglang.srt.disaggregation.utils")  # imports SGLang's model configs: torchvision
    except ImportError as exc:
        pytest.skip(f"sglang.srt.disaggregation.utils does not import here ({exc}); PyPI has no CPU torchvision")
    code = ("import xfer.engine.sglang_plugin as p, xfer.engine.sglang_conn as c; p.install_import_hook('mooncake');"
            "from sglang.srt.disaggregation.utils import get_kv_class, TransferBackend as T, KVClassType as K;"
            "assert get_kv_class(T.MOONCAKE, K.MANAGER) is c.XferKVManager;"
            "assert get_kv_class(T.NIXL, K.MANAGER).__name__ != 'XferKVManager'; print('hooked')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "hooked" in out.stdout, out.stderr[-2000:]
