"""xfer-bench end to end on CPU: the default two-process run (small preset), a sweep, the two
cross-node roles on loopback, a torchrun-style launch, JSON checked against bench/schema.json,
and the errors users hit first (bad flags, unreachable peer, a transport that cannot serve).

Every process a test starts runs in its own session and is killed with its group if it outlives
the test's deadline; the local target is a child of the CLI process and exits with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from xfer.bench import cli, roles
from xfer.bench.presets import PRESETS, fit, with_slice_bytes
from xfer.bench.remote import dist_env
from xfer.bench.schema_check import errors, load_schema
from xfer.shm import pid_alive

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
for _k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):  # never mistake CI for a launcher
    ENV.pop(_k, None)
FAST = ["--iters", "3", "--max-seconds", "0.5"]
HAS_UCX = roles.version("ucxx-cu12") is not None or roles.version("ucxx-cu13") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xfer.bench.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or ENV, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is this process and its children
        out, err = proc.communicate()
        pytest.fail(f"xfer-bench {proc.args[3:]} did not finish within {timeout} s; stderr:\n{err[-3000:]}")
    return proc.returncode, out, err


def _check_doc(doc: dict) -> None:
    assert errors(doc) == [], errors(doc)
    assert doc["verified"] is True
    for rec in doc["workloads"]:
        for run in rec["runs"]:
            if run["status"] == "ok":
                assert run["verified"] is True and run["result"]["gb_per_s"] > 0 and run["result"]["n"] >= 3


@pytest.fixture
def in_process_env(monkeypatch):
    """main() in this process: keep its environment defaults and torch thread count from leaking."""
    for k, v in (("OMP_NUM_THREADS", "1"), ("UCX_NET_DEVICES", "lo"), ("UCX_WARN_UNUSED_ENV_VARS", "n")):
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)


# ---- the default run, the sweep ---------------------------------------------------------------
def test_default_run_small_preset_json(tmp_path):
    rc, out, err = _finish(_start(["--preset", "small", "--json", "--out", str(tmp_path), *FAST]))
    assert rc == 0, err
    doc = json.loads(out)  # stdout is the JSON document alone
    _check_doc(doc)
    assert doc["mode"] == "local" and doc["target"]["pid"] != os.getpid()
    (rec,) = doc["workloads"]
    assert rec["workload"]["slices"] == 4 * 2 * 8 and rec["workload"]["slice_bytes"] == 512
    (run,) = rec["runs"]
    assert run["transport"] == "auto" and run["route"]["kind"] == "local"  # host shared memory on CPU
    names = [b["name"] for b in rec["baselines"]]
    assert names == ["contiguous copy", "per-layer torch indexing", "per-slice copy_ loop"]
    assert rec["baselines"][0]["kind"] == "ceiling" and run["result"]["ceiling"] == "contiguous copy"
    assert run["result"]["post_us"] > 0 and run["result"]["post_cpu_us"] > 0
    folder = Path(doc["results_dir"])
    assert json.loads((folder / "results.json").read_text()) == doc
    assert "xfer write [local]" in (folder / "table.txt").read_text()
    if importlib.util.find_spec("matplotlib"):
        assert (folder / "bandwidth_vs_slice.png").stat().st_size > 1000
    else:
        assert "plots skipped: matplotlib is not installed" in err
    assert f"results: {folder}/" in err
    assert not pid_alive(doc["target"]["pid"]), "the target process outlived the run"


def test_sweep_table(tmp_path, in_process_env, capsys):
    transports = "auto,ucx,ipc" if HAS_UCX else "auto,ipc"
    rc = cli.main(["--preset", "small", "--slice-sizes", "256,1K", "--transport", transports, "--out", str(tmp_path),
                   *FAST])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "workload 2/2" in out and "summary, GB/s by workload" in out and "verified: every destination byte" in out
    (folder,) = tmp_path.iterdir()
    doc = json.loads((folder / "results.json").read_text())
    _check_doc(doc)
    assert [r["workload"]["slice_bytes"] for r in doc["workloads"]] == [256, 1024]
    for rec in doc["workloads"]:
        by = {r["transport"]: r for r in rec["runs"]}
        assert by["auto"]["route"]["kind"] == "local"
        assert by["ipc"]["status"] == "skipped" and "no CUDA device" in by["ipc"]["reason"]
        if HAS_UCX:
            assert by["ucx"]["route"]["kind"] == "ucx" and by["ucx"]["verified"] is True
            assert "contiguous TCP send" in [b["name"] for b in rec["baselines"]]  # the ucx route's ceiling
            assert by["ucx"]["result"]["ceiling"] == "contiguous TCP send"


def test_pinned_transport_that_cannot_serve_exits_5(tmp_path, in_process_env, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("ipc can serve on a GPU machine")
    rc = cli.main(["--preset", "small", "--transport", "ipc", "--out", str(tmp_path), "--quiet", *FAST])
    err = capsys.readouterr().err
    assert rc == 5
    assert "no requested transport can run here" in err and "ipc: no CUDA device in this process" in err
    assert not list(tmp_path.iterdir())  # failed before starting a target


# ---- two roles --------------------------------------------------------------------------------
def test_target_and_initiator_roles_on_loopback(tmp_path):
    port = _free_port()
    target = _start(["--role", "target", "--listen", f"127.0.0.1:{port}", "--idle-timeout", "60"])
    try:
        transport = "ucx" if HAS_UCX else "auto"
        rc, out, err = _finish(_start(["--role", "initiator", "--peer", f"127.0.0.1:{port}", "--preset", "small",
                                       "--transport", transport, "--baselines", "copy,tcp,gloo", "--json",
                                       "--out", str(tmp_path), *FAST]))
        assert rc == 0, err
        trc, _, terr = _finish(target, timeout=30)
    finally:
        if target.poll() is None:
            os.killpg(target.pid, signal.SIGKILL)
            target.wait()
    assert trc == 0 and "stopped by the initiator" in terr
    doc = json.loads(out)
    _check_doc(doc)
    assert doc["mode"] == "cross-node" and doc["target"]["pid"] == target.pid
    (rec,) = doc["workloads"]
    assert rec["runs"][0]["route"]["kind"] == ("ucx" if HAS_UCX else "local")
    assert [b["name"] for b in rec["baselines"]] == ["contiguous copy", "contiguous TCP send", "gloo send/recv"]


def test_torchrun_style_environment(tmp_path):
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    rank0 = _start(["--quiet"], env={**env, "RANK": "0"})
    try:
        rc, out, err = _finish(_start(["--preset", "small", "--json", "--no-plots", "--out", str(tmp_path), *FAST],
                                      env={**env, "RANK": "1"}))
        rc0, _, err0 = _finish(rank0, timeout=30)
    finally:
        if rank0.poll() is None:
            os.killpg(rank0.pid, signal.SIGKILL)
            rank0.wait()
    assert rc == 0 and rc0 == 0, err + err0
    doc = json.loads(out)
    _check_doc(doc)
    assert doc["mode"] == "torchrun" and doc["target"]["pid"] == rank0.pid


# ---- errors -----------------------------------------------------------------------------------
def test_unreachable_peer_is_a_clear_error(tmp_path, in_process_env, capsys):
    port = _free_port()
    rc = cli.main(["--role", "initiator", "--peer", f"127.0.0.1:{port}", "--connect-timeout", "1", "--preset", "small",
                   "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 3
    assert f"cannot reach the xfer-bench target at 127.0.0.1:{port}" in err and "Connection refused" in err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("argv, message", [
    (["--iters", "0"], "--iters must be >= 1, got 0"),
    (["--timeout", "-1"], "--timeout must be > 0 seconds, got -1.0"),
    (["--transport", "tcp"], "'tcp' is not one of auto, local, ipc, nvshmem, ucx"),
    (["--slice-sizes", "1000"], "slice size 1000 B is not a multiple of block_size x itemsize = 32 B"),
    (["--slice-sizes", "4Q"], "expected a byte count such as 512, 4K or 16M, got '4Q'"),
    (["--chunk-bytes", "512"], "--chunk-bytes must be >= 4K, got 512"),
    (["--layouts", "mla"], "--layouts mla do not fit preset seed"),
    (["--baselines", "magic"], "--baselines: unknown ['magic']"),
    (["--role", "initiator"], "--role initiator needs --peer HOST:PORT"),
    (["--role", "target"], "--role target needs --listen HOST:PORT"),
    (["--role", "initiator", "--peer", "10.0.0.1"], "--peer must be HOST:PORT (or [IPv6]:PORT), got '10.0.0.1'"),
    (["--peer", "10.0.0.1:29555"], "--peer is for --role initiator (this is the local role)"),
    (["--role", "initiator", "--listen", "10.0.0.1:29555"], "--listen is for --role target"),
    (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
])
def test_bad_flags_exit_2_with_the_reason(argv, message, in_process_env, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_device_without_gpu_is_a_usage_error(in_process_env, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--device", "cuda", "--preset", "small"])
    assert exc.value.code == 2 and "--device cuda: this machine has 0 CUDA device(s)" in capsys.readouterr().err


def test_launcher_world_size_must_be_two(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--preset", "small"])
    assert exc.value.code == 2 and "torchrun world size must be 2, got 4" in capsys.readouterr().err


# ---- pieces -----------------------------------------------------------------------------------
def test_schema_rejects_what_it_should():
    schema = load_schema()
    try:
        import jsonschema

        jsonschema.Draft202012Validator.check_schema(schema)  # the file is a valid JSON Schema
    except ImportError:
        pass
    problems = errors({"schema": "xfer-bench/2", "mode": "solo"})
    assert "$.schema: expected 'xfer-bench/1', got 'xfer-bench/2'" in problems and "$: missing 'workloads'" in problems
    assert "$.mode: expected one of ['local', 'cross-node', 'torchrun', 'slurm'], got 'solo'" in problems
    row = {"name": "x", "kind": "fast", "transport": None, "chunk_bytes": None, "n": 0, "median_s": 1.0,
           "gb_per_s": 1.0, "slices_per_s": 1.0, "p50_ms": 1.0, "p99_ms": 1.0, "ratio_to_ceiling": None,
           "ceiling": None, "post_us": None, "post_cpu_us": "12"}
    problems = errors(row, {**schema, **schema["$defs"]["row"]})
    assert "$.kind: expected one of ['xfer', 'ceiling', 'baseline'], got 'fast'" in problems
    assert "$.n: 0 is below the minimum 1" in problems
    assert "$.post_cpu_us: expected number or null, got str" in problems


def test_presets_and_fitting():
    seed = PRESETS["seed"]
    assert (seed.slices, seed.slice_bytes, seed.payload_bytes) == (16_384, 32 << 10, 512 << 20)
    fitted = fit(seed, 128 << 20, "test")
    assert (fitted.slices, fitted.slice_bytes) == (16_384, 8 << 10)  # slices kept, slice size fitted
    assert fitted.fitted.startswith("8 KiB slices instead of 32 KiB")
    assert PRESETS["llama3-70b-tp8"].slice_bytes == 4 << 10 and PRESETS["llama3-70b-tp8"].slices == 80 * 2 * 256
    ds = PRESETS["deepseek-v3"]
    assert (ds.num_kv, ds.slice_bytes) == (1, 64 * 576 * 2)
    assert fit(ds, ds.payload_bytes // 4, "test").blocks_moved == ds.blocks_moved // 4  # models keep their shape
    assert with_slice_bytes(seed, 512).head_dim == 16 and with_slice_bytes(ds, 576 * 2 * 16).block_size == 16
    env = dist_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[03-05,07],cpu1",
                    "SLURM_JOB_ID": "77"})
    assert (env.source, env.rank, env.host, env.port) == ("slurm", 1, "gpu03", 29500)


def test_block_digests_threaded_path_matches_slot_by_slot_hashes():
    """A large check hashes its slots on threads (bench/target.py): the same digest per slot, in
    slot order, as BLAKE2b of each slot's blocks in id order; one changed byte changes its slot's only."""
    import hashlib

    import torch

    from xfer import make_kv_cache
    from xfer.bench.target import block_digests

    tensors, layout = make_kv_cache("vllm_flash_attn_nhd", device="cpu", num_layers=4, num_blocks=64, block_size=16,
                                    num_heads=8, head_dim=128)
    gen = torch.Generator().manual_seed(1)
    for t in tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    ids = list(range(63, -1, -2))  # 32 blocks x 256 KiB: above the threaded path's 8 MiB
    assert len(ids) * layout.bytes_per_block >= 8 << 20
    views = layout.views(tensors)
    want = [hashlib.blake2b(v[torch.as_tensor(ids)].contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
                            digest_size=16).hexdigest() for v in views]
    got = block_digests(layout, tensors, ids)
    assert got == want and len(set(got)) == len(got)
    views[3][ids[5]].view(-1).view(torch.uint8)[100] ^= 1  # one bit of one block of slot 3
    changed = block_digests(layout, tensors, ids)
    assert [i for i, (a, b) in enumerate(zip(got, changed)) if a != b] == [3]
