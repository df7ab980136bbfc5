"""xfer's optional C helpers (xfer/_native.c): the same results as the Python path they replace,
the kernel parameters they pack checked against the PTX of the installed Triton, and on a GPU the
bytes a native launch moves against Triton's own launcher."""

from __future__ import annotations

import re
import shutil
import struct
import sysconfig
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

import xfer.layout as layout_mod
from xfer.errors import BlockIdError
from xfer.layout import KVLayout
from xfer.native import C

needs_c = pytest.mark.skipif(C is None, reason="xfer._native is not built here")


def test_built_wherever_a_compiler_is_present():
    """`pip install -e .` builds the helpers where a C compiler and Python's headers are (CI's
    machines have both): a silently failed build would leave every call on the slow path."""
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers:
        pytest.skip("no C compiler or no Python headers here")
    assert C is not None, "xfer._native was not built (see setup.py; pip's build log names the error)"


def _layout(num_blocks: int = 64) -> KVLayout:
    return KVLayout.vllm_flash_attn([torch.zeros(2, num_blocks, 4, 1, 8, dtype=torch.float16) for _ in range(2)])


def _outcome(lay: KVLayout, ids, unique: bool):
    try:
        got = lay.check_block_ids(ids, what="ids", unique=unique)
    except BlockIdError as exc:
        return "error", str(exc)
    return "ok", got.dtype, got.tolist()


def _both(monkeypatch, lay: KVLayout, ids, unique: bool):
    native = _outcome(lay, ids, unique)
    with monkeypatch.context() as m:
        m.setattr(layout_mod, "_native", None)
        python = _outcome(lay, ids, unique)
    return native, python


@needs_c
@pytest.mark.parametrize("ids", [
    [3, 1, 2], [0], [63, 0, 5], [5, 5], [1, 2, 1, 3], [-1, 2], [64], [2, 70, 70], [-3, -3],
    [True, False], [1.0, 2.0], [np.int64(3), np.int64(4)], [2**70, 1], [1, 2**63 - 1],
    np.array([4, 2, 9]), np.array([4, 4]), np.array([1, 2, 3, 4, 5, 6])[::2], np.array([7, -1]),
    np.array([], dtype=np.int64), [], np.array([3, 1], dtype=np.int32), (1, 2), torch.tensor([6, 6]),
    np.array([3, 99], dtype=np.int32), np.array([5, 5], dtype=np.int32), np.array([2**63 + 1], dtype=np.uint64),
    (4, 4), (1, -2), torch.tensor([1, 64]), torch.tensor([2, 3], dtype=torch.int32), torch.arange(8)[::3],
    np.array([[1, 2]]), np.array([1.5]),
])
@pytest.mark.parametrize("unique", [False, True])
def test_id_checks_match_the_python_path(monkeypatch, ids, unique):
    """Every input the C pass takes (lists of ints, contiguous int64 arrays, and once converted
    tensors, other integer arrays and tuples) or declines gives the Python path's array or its
    error, word for word."""
    native, python = _both(monkeypatch, _layout(), ids, unique)
    assert native == python


@needs_c
@hsettings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 2**20), min_size=1, max_size=600),
       st.sampled_from(["list", "int64", "int32", "tensor", "tuple"]), st.booleans(), st.integers(1, 2**20))
def test_id_checks_match_the_python_path_on_random_ids(ids, form, unique, num_blocks):
    """Random ranges (the bitmap below 65,536 ids of span, the hash table above), repeats, lists
    past the 512 the C pass takes (the Python path's sort then), in each form an engine passes."""
    lay = _layout()
    object.__setattr__(lay, "num_blocks", num_blocks)  # (frozen dataclass: the range is all that matters)
    arg = {"list": lambda: ids, "int64": lambda: np.array(ids, dtype=np.int64),
           "int32": lambda: np.array(ids, dtype=np.int32), "tensor": lambda: torch.tensor(ids),
           "tuple": lambda: tuple(ids)}[form]()
    native = _outcome(lay, arg, unique)
    saved = layout_mod._native
    layout_mod._native = None
    try:
        python = _outcome(lay, arg, unique)
    finally:
        layout_mod._native = saved
    assert native == python


@needs_c
def test_id_stats_returns_what_it_found():
    out = np.empty(4, dtype=np.int64)
    assert C.id_stats([9, 2, 7, 2], out, 10, True) == (2, 9, True)
    assert out.tolist() == [9, 2, 7, 2]
    assert C.id_stats([9, 2, 7, 2], out, 10, False) == (2, 9, False)  # repeats asked only when unique
    assert C.id_stats(np.array([5, 1 << 40, 3]), None, 1 << 41, True) == (3, 1 << 40, False)  # hash path
    assert C.id_stats(np.array([5, 1 << 40, 5]), None, 1 << 41, True) == (5, 1 << 40, True)
    assert C.id_stats([1, "x"], np.empty(2, dtype=np.int64), 10, True) is None
    assert C.id_stats(np.array([1.0, 2.0]), None, 10, True) is None
    with pytest.raises(ValueError):
        C.id_stats([1, 2, 3], np.empty(2, dtype=np.int64), 10, True)


@needs_c
def test_same_tensors_is_identity_and_addresses():
    a = [torch.zeros(4) for _ in range(3)]
    refs, ptrs = tuple(weakref.ref(t) for t in a), [t.data_ptr() for t in a]
    dp = torch.Tensor.data_ptr
    assert C.same_tensors(refs, a, ptrs, dp) is True
    assert C.same_tensors(refs, [a[0], a[1], torch.zeros(4)], ptrs, dp) is False  # another object
    assert C.same_tensors(refs, a[:2], ptrs, dp) is False  # another length
    moved = list(a)
    a[2].set_(torch.zeros(8).untyped_storage())  # same object, other memory
    assert C.same_tensors(refs, moved, ptrs, dp) is False
    b = [torch.zeros(2)]
    dead = (weakref.ref(torch.zeros(2)),)
    assert C.same_tensors(dead, b, [b[0].data_ptr()], dp) is False
    with pytest.raises(TypeError):
        C.same_tensors((b[0],), b, [b[0].data_ptr()], dp)  # not a weak reference


@needs_c
def test_side_memory_uses_it_and_still_notices_moves():
    """The functional copies' side memory with the C check: a repeat call reuses the check, a tensor
    moved to other memory is checked anew (and its new address used)."""
    from xfer.kernels import sides

    caches = [torch.zeros(2, 8, 4, 1, 8, dtype=torch.float16) for _ in range(4)]
    lay = KVLayout.vllm_flash_attn(caches)
    first = sides._side(lay, caches)
    assert sides._side(lay, caches).info is first.info
    caches[1].set_(torch.zeros_like(caches[1]).untyped_storage())
    again = sides._side(lay, caches)
    assert again.info is not first.info and again.ptrs[1] == caches[1].data_ptr()


@needs_c
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 100, 513, 2000])
@pytest.mark.parametrize("sort", [True, False])
def test_put_ids_orders_pairs_by_destination(n, sort):
    rng = np.random.default_rng(n)
    src, dst = rng.integers(0, 10**6, n), rng.permutation(10**6)[:n]
    host = np.full(2 * n + 3, -7, dtype=np.int64)
    C.put_ids(host.ctypes.data, host.size, src, dst, sort, 0, 0, 0)  # dev 0: written, nothing queued
    order = np.argsort(dst, kind="stable") if sort else np.arange(n)
    assert host[:n].tolist() == src[order].tolist()
    assert host[n:2 * n].tolist() == dst[order].tolist()
    assert host[2 * n:].tolist() == [-7, -7, -7]  # nothing past the pairs


@needs_c
def test_put_ids_refuses_what_does_not_fit():
    host = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="3 source and 3 destination ids for 4 words"):
        C.put_ids(host.ctypes.data, host.size, np.arange(3), np.arange(3), True, 0, 0, 0)
    with pytest.raises(ValueError):
        C.put_ids(host.ctypes.data, host.size, np.arange(2), np.arange(1), True, 0, 0, 0)
    with pytest.raises(TypeError):
        C.put_ids(host.ctypes.data, host.size, np.arange(4)[::2], np.arange(2), True, 0, 0, 0)
    assert host.tolist() == [0, 0, 0, 0]


@needs_c
def test_launch_packs_the_integers_at_their_widths():
    ints = (5, 640, 1 << 33, -3, 1, 2, 3, 4, 5, 6)
    wide = 0b100  # the third is 64-bit
    spec = C.pack_spec(0xABC, 0x1000, 80, 256, 0, 0, ints, wide)
    got = C.launch(spec, 0x2000, None)  # None: nothing launched, the parameters returned
    assert got == struct.pack("<QQiiqiiiiiiiQQ", 0x1000, 0x2000, 5, 640, 1 << 33, -3, 1, 2, 3, 4, 5, 6, 0, 0)
    with pytest.raises(ValueError, match="does not fit 32 bits"):
        C.pack_spec(1, 1, 1, 32, 0, 0, (1 << 33,), 0)
    with pytest.raises(TypeError):
        C.launch(b"short", 0, None)


@needs_c
def test_launch_spec_matches_the_compiled_kernels_parameters(monkeypatch):
    """The installed Triton compiles the copy kernel for a Hopper target (no GPU needed); the
    parameters the C launch passes must be the PTX entry's, in order and width (two pointers, the
    integers, then Triton's scratch pointers, passed as NULL)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton.language as tl
    from xfer.kernels import copy as kc

    fn = kc._kernel(False)
    names = fn.arg_names
    ints = (128, 16384, 1 << 32, 4096, 0, 0, 0, 0, 0, 0)  # s_blk over 32 bits: an i64 parameter
    sig = {name: "constexpr" for name in names}
    sig.update(tab_ptr="*i64", ids_ptr="*i64")
    for name, v in zip(kc._INTS, ints):
        sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
    consts = dict(SLOTS=128, D0=1, D1=1, D2=1, RUN=512, CHUNK=512, CHUNKS=1, ROWS=2, WORD=tl.int64,
                  WORD_BYTES=8, ALIGN=16)
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    entry = re.search(r"\.entry\s+\w+\((.*?)\)", compiled.asm["ptx"], re.S).group(1)
    widths = [int(w) // 8 for w in re.findall(r"\.param\s+\.[us](\d+)", entry)]

    monkeypatch.setattr(type(compiled), "_init_handles", lambda self: None)
    monkeypatch.setattr(type(compiled), "run", property(lambda self: object()))
    compiled.function = 0x1234
    key = ("test", id(compiled))
    monkeypatch.setitem(kc._COMPILED, key, compiled)

    class Table:
        def data_ptr(self):
            return 0x7000

    spec = kc._native_spec(key, 96, (Table(), None, *ints), 0)
    assert spec is not None
    packed = C.launch(spec, 0x8000, None)
    sizes = [8, 8] + [4 if -2**31 <= v < 2**31 else 8 for v in ints] + [8, 8]
    assert sizes[:len(widths)] == widths, f"PTX parameters {widths}, packed {sizes}"
    assert len(widths) <= len(sizes)
    assert packed[:16] == struct.pack("<QQ", 0x7000, 0x8000)

    # a launch that needs what cuLaunchKernel alone does not give keeps Triton's launcher
    monkeypatch.setattr(compiled.metadata.__class__, "num_ctas", property(lambda self: 2), raising=False)
    assert kc._native_spec(key, 96, (Table(), None, *ints), 0) is None


def test_launch_knob(monkeypatch):
    """The C launch is on by default (XFER_NATIVE_LAUNCH=0 turns it off) and needs the module and
    libcuda; never on CPU."""
    from xfer import settings
    from xfer.kernels import copy as kc

    monkeypatch.delenv("XFER_NATIVE_LAUNCH", raising=False)
    settings.reload()
    assert kc.native_launch(torch.device("cuda", 0)) is (C is not None and C.driver())  # the default
    assert kc.native_launch(torch.device("cpu")) is False
    try:
        monkeypatch.setenv("XFER_NATIVE_LAUNCH", "1")
        settings.reload()
        assert kc.native_launch(torch.device("cuda", 0)) is (C is not None and C.driver())
        assert kc.native_launch(torch.device("cpu")) is False
        monkeypatch.setenv("XFER_NATIVE_LAUNCH", "0")
        settings.reload()
        assert kc.native_launch(torch.device("cuda", 0)) is False
    finally:
        monkeypatch.delenv("XFER_NATIVE_LAUNCH")
        settings.reload()


@pytest.fixture
def native_on(monkeypatch):
    """XFER_NATIVE_LAUNCH=1 for one test, whatever the default."""
    from xfer import settings

    monkeypatch.setenv("XFER_NATIVE_LAUNCH", "1")
    settings.reload()
    yield
    monkeypatch.delenv("XFER_NATIVE_LAUNCH")
    settings.reload()


@pytest.mark.gpu
@needs_c
@pytest.mark.parametrize("inner", ["nhd", "hnd"])
def test_gpu_native_launch_moves_the_bytes_tritons_launcher_moves(native_on, inner):
    """On a GPU: the repeat copies between two cached caches go through the C launch (checked),
    and every byte matches the reference; the untouched blocks stay poisoned."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from xfer.kernels import BoundCopy
    from xfer.kernels.copy import _put_native

    def caches(fill):
        shape = (2, 256, 16, 4, 64) if inner == "nhd" else (2, 256, 4, 16, 64)
        ts = [torch.full(shape, fill, dtype=torch.float16, device="cuda") for _ in range(8)]
        if inner == "hnd":
            ts = [t.permute(0, 1, 3, 2, 4) for t in ts]
        return ts

    src = caches(0.0)
    for t in src:
        t.copy_(torch.randn_like(t.float()).half())
    dst = caches(-7.0)
    lay_s, lay_d = KVLayout.vllm_flash_attn(src), KVLayout.vllm_flash_attn(dst)
    bound = BoundCopy(lay_s, src, lay_d, dst)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(3)
    for rnd in range(4):  # the first launch compiles through Triton, the later ones go native
        s_ids = rng.permutation(256)[:37]
        d_ids = rng.permutation(256)[:37]
        ev = bound.copy(s_ids, d_ids, stream=stream, path=None, record_stream=False)
        ev.synchronize()
        for a, b in zip(src, dst):
            assert torch.equal(b[:, torch.as_tensor(d_ids, device="cuda")], a[:, torch.as_tensor(s_ids, device="cuda")])
        for t in dst:
            t.fill_(-7.0)
    pair = next(iter(bound._tables.values()), None) or next(
        v for v in bound.src.pairs.values() if hasattr(v, "native"))
    assert pair.native is not None and isinstance(pair.native.get(37), bytes), "the C launch was not used"
    assert pair._put is _put_native
    untouched = [i for i in range(256) if i not in set(d_ids.tolist())]
    ev = bound.copy(s_ids, d_ids, stream=stream, record_stream=False)
    ev.synchronize()
    for t in dst:
        assert bool((t[:, untouched] == -7.0).all())


@needs_c
def test_host_checks_bench_runs_both_modes_and_restores(tmp_path):
    """bench/host_checks.py times the checks with and without the C helpers in one process and
    leaves them in use afterwards."""
    import json

    from xfer.bench import host_checks
    from xfer.kernels import sides

    res = host_checks.main(["--layers", "4", "--n", "8", "--number", "20", "--repeat", "1",
                            "--out", str(tmp_path / "hc.json")])
    assert [r["what"] for r in res["rows"]][0] == "check_ids, int64 arrays"
    assert all(r["python_us"] > 0 and r["native_us"] > 0 for r in res["rows"])
    assert json.loads((tmp_path / "hc.json").read_text())["rows"] == res["rows"]
    assert layout_mod._native is C and sides._native is C


@pytest.mark.gpu
@needs_c
def test_gpu_host_checks_cuda_pieces(tmp_path):
    """``host_checks --cuda`` checks the copy's bytes, times the CUDA half's pieces with the C launch
    on and off, profiles whole calls, and leaves the pair as it found it."""
    from xfer.bench import host_checks

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    res = host_checks.main(["--layers", "4", "--n", "8", "--number", "50", "--repeat", "1", "--cuda",
                            "--profile-calls", "20"])
    rows = {r["what"]: r for r in res["cuda"]["rows"]}
    assert set(rows) >= {"ids upload + launch + event + release", "copy_blocks, the whole call"}
    assert all(r["triton_launch_us"] > 0 and (r["native_launch_us"] or 0) >= 0 for r in rows.values())
    assert res["cuda"]["profile"] and res["cuda"]["profile"][0]["calls"] >= 1


_FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <string.h>
typedef int CUresult;
static int ctx_token;
static void *current;
int retained = -1, set_calls, launches, htod_calls;
unsigned long long launch_args[10], params_seen[16];
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { current = ctx; set_calls++; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) { retained = device; *ctx = &ctx_token; return 0; }
CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *stream) {
    if ((uintptr_t)stream == 0xbad) return 1;
    memcpy((void *)(uintptr_t)dst, src, n); htod_calls++; return 0;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
    unsigned long long a[10] = {(uintptr_t)f, gx, gy, gz, bx, by, bz, shared, (uintptr_t)stream, (uintptr_t)extra};
    memcpy(launch_args, a, sizeof a);
    for (int i = 0; i < 14; i++) memcpy(&params_seen[i], params[i], 8);
    launches++;
    return (uintptr_t)f == 0xdead ? 700 : 0;
}
"""

_DRIVER_SCRIPT = r"""
import ctypes, struct, sys
import numpy as np
lib = ctypes.CDLL(sys.argv[1])  # the fake, by its soname libcuda.so.1: what xfer._native dlopens
from xfer.native import C
g = lambda name, t=ctypes.c_int: t.in_dll(lib, name).value
assert C.driver() is True
dev = np.full(10, -1, dtype=np.int64)  # host memory standing in for the device buffer
host = np.zeros(10, dtype=np.int64)
C.put_ids(host.ctypes.data, 10, np.array([7, 8, 9]), np.array([30, 10, 20]), True, dev.ctypes.data, 0x5, 3)
assert g("retained") == 3 and g("set_calls") == 1, "no current context: device 3's primary one made current"
assert dev[:6].tolist() == [8, 9, 7, 10, 20, 30] and dev[6:].tolist() == [-1] * 4, dev
assert g("htod_calls") == 1
ints = (3, 96, 1 << 33, 4096, 1, 2, 3, 4, 5, 6)
spec = C.pack_spec(0x1234, 0x7000, 24, 256, 512, 3, ints, 0b100)
C.launch(spec, dev.ctypes.data, 0x5)
la = (ctypes.c_ulonglong * 10).in_dll(lib, "launch_args")
assert list(la) == [0x1234, 24, 1, 1, 256, 1, 1, 512, 0x5, 0], list(la)
ps = list((ctypes.c_ulonglong * 16).in_dll(lib, "params_seen"))[:14]
widths = [8, 8, 4, 4, 8, 4, 4, 4, 4, 4, 4, 4, 8, 8]
want = [0x7000, dev.ctypes.data, *ints, 0, 0]
got = [p & ((1 << 8 * w) - 1) for p, w in zip(ps, widths)]
want = [v & ((1 << 8 * w) - 1) for v, w in zip(want, widths)]
assert got == want, (got, want)
assert g("set_calls") == 1, "a current context is left as it is"
try:
    C.launch(C.pack_spec(0xdead, 0x7000, 1, 32, 0, 0, ints, 0b100), 1, 0x5)
except RuntimeError as exc:
    assert "cuLaunchKernel failed with CUDA error 700" in str(exc), exc
else:
    raise AssertionError("a failed launch must raise")
try:
    C.put_ids(host.ctypes.data, 10, np.array([1]), np.array([2]), True, dev.ctypes.data, 0xbad, 0)
except RuntimeError as exc:
    assert "cuMemcpyHtoDAsync of the block ids failed with CUDA error 1" in str(exc), exc
else:
    raise AssertionError("a failed upload must raise")
print("ok")
"""


@needs_c
def test_driver_calls_against_a_fake_libcuda(tmp_path):
    """The C path's driver calls on a machine without CUDA: a stand-in libcuda.so.1 (built here,
    loaded in a child process) records what it is called with. The ids land sorted at the device
    address; a thread without a context gets the device's primary one; cuLaunchKernel gets the grid,
    block, shared bytes, stream and every parameter at its width; driver errors raise with their code."""
    import subprocess
    import sys

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    src = tmp_path / "fake.c"
    src.write_text(_FAKE_LIBCUDA)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", str(src), "-o", str(lib)], check=True)
    script = tmp_path / "drive.py"
    script.write_text(_DRIVER_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(lib)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]
