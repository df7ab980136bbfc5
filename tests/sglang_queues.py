"""SGLang 0.5.23's own decode queue code on CPU, for the opt-in backend tests.

``DecodePreallocQueue.add``, ``_resolve_pending_reqs`` and ``_update_handshake_waiters`` (what the
decode scheduler runs every step) and ``poll_and_all_reduce`` (the transfer queue's polling) run
unchanged against xfer's manager and receivers, over a one-process gloo group. The queue object
is made with ``__new__`` and given the attributes those methods read: building it for real needs
a model runner and a KV pool, which this CPU machine does not have. Its KV-capacity admission
check (which reads the pool) is the one method replaced.

SGLang's model configs import torchvision, whose PyPI wheels are CUDA builds that do not load
next to CPU torch: ``import_decode`` puts an import-only stand-in in its place when it is missing.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from types import SimpleNamespace


class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


def _stub_torchvision() -> None:
    """An import-only torchvision (the decode queue never calls it on this path)."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return

    class _Module(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything(name, (), {"__init__": lambda self, *a, **k: None})

    root = _Module("torchvision")
    root.__version__ = "0.28.0"
    root.__path__ = []
    root.__spec__ = importlib.machinery.ModuleSpec("torchvision", None, is_package=True)
    sys.modules["torchvision"] = root
    for sub in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "io",
                "ops", "models"):
        m = sys.modules[f"torchvision.{sub}"] = _Module(f"torchvision.{sub}")
        m.__spec__ = importlib.machinery.ModuleSpec(f"torchvision.{sub}", None)
    root.transforms = sys.modules["torchvision.transforms"]


def import_decode():
    """SGLang's ``disaggregation.decode`` and ``utils`` modules (with xfer's hook installed)."""
    _stub_torchvision()
    from sglang.srt.disaggregation import decode, utils

    from xfer.engine.sglang_plugin import install
    install("mooncake")  # SGLang's get_kv_class(MOONCAKE, ...) now returns xfer's classes
    return decode, utils


def gloo_group(port: int):
    """A one-process gloo group (SGLang all-reduces poll states over it)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.group.WORLD


def request(rid: str, addr: str, room: int):
    """The fields of SGLang's ``Req`` the decode prealloc queue reads on the bootstrap path."""
    host, port = addr.rsplit(":", 1)
    return SimpleNamespace(rid=rid, bootstrap_host=host, bootstrap_port=int(port), bootstrap_room=room,
                           disagg_prefill_dp_rank=None, finished_reason=None, to_finish=None, is_retracted=False,
                           kv=SimpleNamespace(holds_kv=False, holds_mamba=False, retraction_backup=None),
                           metadata_buffer_index=-1, return_logprob=False,
                           time_stats=SimpleNamespace(set_bootstrap_done_time=lambda: None))


def prealloc_queue(decode, kv_manager, group, monkeypatch):
    """A ``DecodePreallocQueue`` holding what ``add``/``_resolve_pending_reqs``/``_update_handshake_waiters`` read."""
    monkeypatch.setattr(decode, "get_disagg", lambda: SimpleNamespace(
        disaggregation_decode_allocation_policy="early", disaggregation_transfer_backend="mooncake"))
    q = decode.DecodePreallocQueue.__new__(decode.DecodePreallocQueue)
    q.kv_manager, q.gloo_group = kv_manager, group
    q.queue, q.pending_reqs, q.retracted_queue = [], [], []
    q.transfer_backend = decode.TransferBackend.MOONCAKE
    q.scheduler = SimpleNamespace(retire_unadmitted_request=lambda req: None,
                                  metrics_reporter=SimpleNamespace(enable_metrics=False))
    q.pp_size, q.tp_rank = 1, 0
    q._prefill_dp_rank_queries, q._ensure_retry_count, q._ensure_last_attempt_time = {}, {}, {}
    q._max_ensure_retries, q._ensure_retry_interval = 15, 1.0  # SGLang's own values
    q._check_if_req_exceed_kv_capacity = lambda req: False  # reads the KV pool, not built here
    return q


def scheduler_step(q) -> None:
    """What the decode scheduler runs on the prealloc queue each step before preallocating."""
    q._resolve_pending_reqs()
    q._update_handshake_waiters()
