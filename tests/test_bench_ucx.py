"""pytest-benchmark of the UCX transport: xfer ``write`` between two processes on loopback, beside
the same-bytes contiguous TCP send measured in the same session.

    OMP_NUM_THREADS=1 python -m pytest tests/test_bench_ucx.py --benchmark-columns=median,ops

Cases as in bench/ucx_bench.py (the 512 MiB seed case only with ``-m slow``). Each benchmark checks
the destination bytes first; ``extra_info`` carries GB/s and the ratio to the TCP ceiling.
"""

from __future__ import annotations

import base64
import os
import socket
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx", reason="the UCX transport needs ucxx: pip install -e '.[ucx]'")

from xfer.bench.target import block_digests  # noqa: E402
from xfer.bench.ucx_bench import CASES, KIND, Server, dims_of, ids_of  # noqa: E402

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


@pytest.fixture(scope="module")
def server():
    s = Server("127.0.0.1", None)
    yield s
    s.close()


def _tcp_seconds(server, port: int, data: np.ndarray, iters: int = 5) -> float:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(iters + 1):
        th, _ = server.call_async(op="serve", what="tcp", iters=1)
        t0 = time.perf_counter()
        sock.sendall(memoryview(data))
        sock.recv(1)
        times.append(time.perf_counter() - t0)
        th.join()
    sock.close()
    return float(np.median(times[1:]))


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("64x") else c
                                  for c in CASES])
def test_bench_xfer_write(benchmark, server, case):
    from xfer import Agent, AgentConfig, make_kv_cache

    prep = server.call(op="prepare", case=case)
    tensors, layout = make_kv_cache(KIND, **dims_of(case))
    gen = torch.Generator().manual_seed(1)
    for t in tensors:
        b = t.view(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    src, dst = (np.asarray(x, dtype=np.int64) for x in ids_of(case))
    with Agent("bench-src", AgentConfig(transport="ucx", default_timeout_s=60)) as agent:
        agent.register("kv", tensors, layout)
        peer = agent.connect(base64.b64decode(prep["metadata"]))
        agent.write(peer, src, dst).wait()
        check = server.call(op="check", ids=dst.tolist())
        assert check["digests"] == block_digests(layout, tensors, src) and check["untouched"]
        ceiling = _tcp_seconds(server, prep["tcp"], np.ones(prep["nbytes"], np.uint8))
        benchmark.pedantic(lambda: agent.write(peer, src, dst).wait(), rounds=5, warmup_rounds=1)
        med = benchmark.stats.stats.median
        benchmark.extra_info.update(gb_per_s=prep["nbytes"] / med / 1e9, tcp_gb_per_s=prep["nbytes"] / ceiling / 1e9,
                                    ratio_to_tcp=ceiling / med)
