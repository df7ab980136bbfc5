"""Every measurement across GPUs of one node (issue 33) in one call, the ceilings in the same call.

    python -m xfer.bench.multigpu --out DIR [--quick] [--parts ipc,nccl,...] [--pairs 0:1] [--budget-s 540]
    python -m xfer.bench.multigpu --dry-run [--gpus 2]     # the plan only, no GPU needed

Counts the GPUs and runs, between GPU 0 and GPU 1 (the *pair*; with one GPU, the two-process
variant of each on GPU 0, said so in the JSON), each part in its own process (own session, killed
with its children at its time cap), in this order:

- ``ceiling``: ``cudaMemcpyPeerAsync`` of the seed case's 512 MiB, contiguous, push and pull, lone
  and back to back, peer access enabled (``peer_copy``); every pair ``0:k`` on machines of more GPUs;
- ``nccl``: NCCL send/recv of the same bytes, one process a GPU (``nccl_baseline``; needs 2 GPUs);
- ``ipc``: the seed case over ``ipc``, push and pull, lone and back to back (at most 8 in flight,
  one per block set: the targets' grants refuse two unfenced writers of a block), with its own
  ``cudaMemcpyPeerAsync`` ceiling timed after it (``ipc_bench --peer-ceiling --pull-burst --window 8``);
- ``p2p``: how a copy on GPU 0 reaches a CUDA-IPC mapping of GPU 1's memory (``p2p_probe``);
- ``nvshmem``: two PEs, one per GPU, staged and direct (``nvshmem_bench --peer-ceiling``; back to
  back over two disjoint sets of decode blocks, ``--burst-window 2``);
- ``engine``: prefill on GPU 0 (this machine's process), decode on GPU 1: token equality with
  single-process generation, TTFT share of the transfer (``engine_bench --decode-device``);
- ``ucx``: the UCX transport on device memory across the two GPUs (``ucx_bench --peer-device``);
- ``xferbench``: ``xfer-bench --device cuda`` and its default peer device (GPU 1 when there are two);
- ``tests``: the GPU tests' multi-GPU cases (``tests/test_multigpu.py`` and the ``0 -> 1`` cases of
  ``test_ipc`` / ``test_nvshmem``; ``--tests all``: the whole GPU suite);
- ``extra``: ``ipc`` (quick) for every further pair ``0:k``, as the budget allows.

Each part's JSON goes into the one document ``DIR/multigpu.json`` (rewritten after every part:
what ran survives a kill), with the date, GPUs, topology, driver and versions, beside each part's
log. A part that cannot run says why (``skipped``); one that failed keeps its log's tail. The
``--budget-s`` bounds the whole run: a part starts only with time left, and runs at most until
the budget ends. ``--quick``: fewer iterations and a tiny engine model (the one-GPU smoke test,
about 2-3 minutes). NVLink multicast stays off in every process (``peer_copy.NO_MULTICAST``).
``python -m xfer.bench.multigpu_table DIR/multigpu.json`` turns the result into table rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from xfer.bench.peer_copy import NO_MULTICAST, parse_pairs

__all__ = ["PARTS", "Part", "gpu_pairs", "availability", "plan", "run", "main"]

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("ceiling", "nccl", "ipc", "p2p", "nvshmem", "engine", "ucx", "xferbench", "tests", "extra")
CAPS = {  # part -> (cap s, quick cap s): how long one part may run at most
    "ceiling": (90, 60), "nccl": (120, 60), "ipc": (180, 90), "p2p": (120, 90), "nvshmem": (240, 120),
    "engine": (300, 120), "ucx": (180, 120), "xferbench": (240, 120), "tests": (300, 120), "extra": (120, 90)}
MIN_START_S = 20.0  # a part is not started with less time than this left in the budget
MULTI_GPU_TESTS = "devs1 or cuda0-cuda1 or test_multigpu"  # -k: the 0 -> 1 cases of test_ipc / test_nvshmem


@dataclass(frozen=True)
class Part:
    """One measurement: its command (None: it does not run), why not (``skip``), its time cap."""

    name: str
    key: str  # unique in a run, e.g. "ipc" or "extra 0->2"
    cmd: tuple[str, ...] | None
    cap_s: float
    out: str | None = None  # the JSON file the command writes (relative to the run's folder)
    skip: str | None = None
    stdout_json: bool = False  # the command prints its JSON on stdout (xfer-bench --json)
    env: tuple[tuple[str, str], ...] = field(default=())
    in_repo: bool = False  # run from the repository root (pytest), not from the run's folder


def gpu_pairs(n: int, pairs: str | None = None) -> list[tuple[int, int]]:
    """The pairs measured: ``pairs`` if given, else ``0:1`` and then ``0:k`` for every further
    GPU; ``0:0`` (two processes on one GPU) with one GPU; none without a GPU."""
    if pairs:
        return parse_pairs(pairs, n)
    if n <= 0:
        return []
    if n == 1:
        return [(0, 0)]
    return [(0, k) for k in range(1, n)]


def availability() -> dict[str, str | None]:
    """Per optional package: None when importable here, else why a part needing it is skipped."""
    need = {"nvshmem": ("nvshmem", "nvshmem4py is not installed (carry the nvshmem4py-cu13 wheel in .whl/)"),
            "ucx": ("ucxx", "ucxx is not installed (carry the ucxx-cu13 wheels in .whl/)"),
            "engine": ("transformers", "transformers is not installed (pip install -e '.[engine]')")}
    return {k: (None if importlib.util.find_spec(mod) is not None else why) for k, (mod, why) in need.items()}


def plan(n: int, *, quick: bool, parts: tuple[str, ...] = PARTS, have: dict | None = None, pairs: str | None = None,
         tests: str = "multi") -> list[Part]:
    """The parts to run on a machine of ``n`` GPUs, in order (pure: no GPU touched)."""
    have = availability() if have is None else have
    py, m = sys.executable, "xfer.bench."
    found = gpu_pairs(n, pairs)
    if not found:
        return [Part(p, p, None, 0, skip="no CUDA GPU on this machine") for p in parts]
    (a, b), extras = found[0], found[1:]
    one_gpu = a == b
    it = (lambda full, fast: str(fast if quick else full))
    cap = (lambda p: float(CAPS[p][1 if quick else 0]))
    out: list[Part] = []

    def add(name, cmd, *, skip=None, key=None, **kw):
        if name in parts:
            out.append(Part(name, key or name, None if skip else tuple(cmd), cap(name), skip=skip, **kw))

    every = ",".join(f"{x}:{y}" for x, y in found)
    add("ceiling", [py, "-m", m + "peer_copy", "--pairs", every, "--iters", it(20, 5), "--out", "ceiling.json"],
        out="ceiling.json")
    add("nccl", [py, "-m", m + "nccl_baseline", "--devices", f"{a},{b}", "--iters", it(20, 5), "--out", "nccl.json"],
        out="nccl.json", skip=f"needs 2 GPUs (this machine has {n}): NCCL refuses two ranks on one GPU" if one_gpu else None)
    add("ipc", [py, "-m", m + "ipc_bench", "--device", str(a), "--peer-device", str(b), "--no-copy-paths",
                "--peer-ceiling", "--pull-burst", "--window", "8", "--iters", it(30, 5), "--out", "ipc.json"],
        out="ipc.json")
    add("p2p", [py, "-m", m + "p2p_probe", "--local", str(a), "--peer", str(b), "--out", "p2p.json",
                *(["--allocs", "legacy"] if quick else [])], out="p2p.json")
    add("nvshmem", [py, "-m", m + "nvshmem_bench", "--pes", "2", "--device", str(a), "--peer-device", str(b),
                    "--peer-ceiling", "--burst-window", "2", "--iters", it(30, 5), "--out", "nvshmem.json"],
        out="nvshmem.json",
        skip=have.get("nvshmem"))
    model = ["--model", "tiny", "--prompt", "256", "--new", "8", "--iters", "3", "--warmup", "1"] if quick else \
        ["--model", "8b", "--prompt", "4096", "--new", "16", "--iters", "15", "--warmup", "2"]
    add("engine", [py, "-m", m + "engine_bench", *model, "--device", f"cuda:{a}", "--decode-device", f"cuda:{b}",
                   "--out", "engine.json"], out="engine.json", skip=have.get("engine"))
    add("ucx", [py, str(ROOT / "bench" / "ucx_bench.py"), "--device", f"cuda:{a}", "--peer-device", f"cuda:{b}",
                "--cases", "64x128x32KiB", "--iters", it(7, 2), "--json", "ucx.json"], out="ucx.json",
        skip=have.get("ucx"), env=(("UCX_PROTO_INFO", "y"),))
    fast = ["--iters", "3", "--max-seconds", "0.5"] if quick else []
    add("xferbench", [py, "-m", m + "cli", "--device", "cuda", "--transport", "auto,ipc,nvshmem,ucx",
                      "--baselines", "copy,nccl", "--out", "xfer-bench", "--no-plots", "--quiet", "--json", *fast],
        out="xfer-bench.json", stdout_json=True)
    files = ["tests/test_multigpu.py"] + ([] if one_gpu else ["tests/test_ipc.py", "tests/test_nvshmem.py"])
    select = ["tests"] if tests == "all" else [*files, "-k", MULTI_GPU_TESTS]
    add("tests", [py, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "--timeout-method=thread",
                  "--timeout", "180", "-rs", *select], in_repo=True)
    for x, y in extras:
        add("extra", [py, "-m", m + "ipc_bench", "--device", str(x), "--peer-device", str(y), "--no-copy-paths",
                      "--peer-ceiling", "--window", "8", "--iters", "5", "--out", f"ipc-{x}-{y}.json"],
            key=f"extra {x}->{y}", out=f"ipc-{x}-{y}.json")
    return out


def _leftovers() -> list[str]:
    """Kill whatever a part left on a GPU (a hung PE would slow every later figure down)."""
    try:
        res = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    killed = []
    for line in res.stdout.splitlines():
        pid = line.split(",")[0].strip()
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(line.strip())
            except OSError:
                pass
    return killed


def _execute(part: Part, timeout: float, folder: Path) -> dict:
    """Run one part; its record (status, rc, wall_s, log, result or the log's tail)."""
    log = folder / f"{part.key.replace(' ', '-').replace('>', '')}.log"
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1", **dict(part.env)}
    rec: dict = {"cmd": list(part.cmd), "log": log.name, "timeout_s": round(timeout)}
    t0 = time.monotonic()
    with open(log, "w") as lf, open(folder / part.out, "w") if part.stdout_json else open(os.devnull, "w") as so:
        proc = subprocess.Popen(part.cmd, cwd=ROOT if part.in_repo else folder, env=env, stdout=so if part.stdout_json else lf,
                                stderr=lf if part.stdout_json else subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout)
            rec["status"] = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, rec["status"] = None, "timeout"
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its children too (spawned peers, PEs)
        except OSError:
            pass
        proc.wait()
    rec.update(rc=rc, wall_s=round(time.monotonic() - t0, 1))
    left = _leftovers()
    if left:
        rec["killed_leftovers"] = left
    if part.out and (folder / part.out).is_file():
        try:
            rec["result"] = json.loads((folder / part.out).read_text())
        except ValueError as exc:
            rec["result_error"] = f"{part.out} is not JSON: {exc}"
    text = log.read_text(errors="replace")
    if part.name == "tests":
        rec["counts"] = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", text[-600:])}
        if rc == 5:  # nothing selected here (one GPU: every multi-GPU case skips or is deselected)
            rec["status"] = "ok"
    if rec["status"] != "ok" or "result" not in rec and part.out:
        rec["log_tail"] = text[-4000:]
    return rec


def run(parts: list[Part], folder: Path, doc: dict, budget_s: float, execute=_execute) -> dict:
    """Run ``parts`` in order within ``budget_s``; ``doc["parts"]`` filled and written after each."""
    deadline = time.monotonic() + budget_s
    doc.setdefault("parts", {})
    for part in parts:
        left = deadline - time.monotonic()
        if part.skip or part.cmd is None:
            rec = {"status": "skipped", "reason": part.skip}
        elif left < min(part.cap_s, MIN_START_S):
            rec = {"status": "skipped", "reason": f"budget: {max(0.0, left):.0f} s left of --budget-s {budget_s:g}"}
        else:
            print(f"multigpu: {part.key}: {' '.join(part.cmd[1:])}", flush=True)
            rec = execute(part, min(part.cap_s, left), folder)
        doc["parts"][part.key] = rec
        print(f"multigpu: {part.key}: {rec['status']}" + (f" ({rec.get('reason')})" if rec.get("reason") else "")
              + (f", {rec['wall_s']} s" if "wall_s" in rec else ""), flush=True)
        (folder / "multigpu.json").write_text(json.dumps(doc, indent=1))
    return doc


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "triton", "transformers", "ucxx-cu13", "ucxx-cu12", "libucx-cu13", "nvshmem4py-cu13",
                 "nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nvshmem-cu13", "cuda-bindings"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        out["xfer_commit"] = head.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["xfer_commit"] = None
    return out


def environment(n: int) -> dict:
    """Date, GPUs (nvidia-smi), how they are linked (``topo -m``), driver and versions."""
    def smi(*args) -> str | None:
        try:
            return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return None

    gpus = smi("--query-gpu=index,name,uuid,driver_version,memory.total,pci.bus_id", "--format=csv,noheader")
    rows = [dict(zip(("index", "name", "uuid", "driver", "memory", "pci"), (x.strip() for x in line.split(","))))
            for line in (gpus or "").splitlines() if line.strip()]
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "gpus": n, "device": rows[0]["name"] if rows else None, "devices": rows,
            "driver": rows[0]["driver"] if rows else None, "topology": smi("topo", "-m"),
            "versions": _versions(), "env": dict(NO_MULTICAST)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="xfer-multigpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="multigpu-out", help="folder for multigpu.json, the parts' files and logs")
    p.add_argument("--quick", action="store_true", help="fewer iterations, tiny engine model (the smoke test)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in this order: {','.join(PARTS)}")
    p.add_argument("--pairs", help="GPU pairs SRC:DST, the first measured in full (default: 0:1, then 0:k)")
    p.add_argument("--tests", choices=("multi", "all"), default="multi",
                   help="multi: the multi-GPU cases; all: the whole GPU suite (long: give it its own call)")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time, s (default 540)")
    p.add_argument("--gpus", type=int, help="plan for this many GPUs instead of counting them (with --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = p.parse_args(argv)
    parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown {unknown}; known: {','.join(PARTS)}")
    if args.gpus is not None:
        n = args.gpus
    else:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        todo = plan(n, quick=args.quick, parts=parts, pairs=args.pairs, tests=args.tests)
    except ValueError as exc:
        p.error(str(exc))
    pairs = gpu_pairs(n, args.pairs)
    mode = ("no GPU" if not pairs else "two processes on one GPU (the one-GPU variant)" if pairs[0][0] == pairs[0][1]
            else f"GPU {pairs[0][0]} -> GPU {pairs[0][1]}")
    print(f"multigpu: {n} GPU(s): {mode}; {'quick' if args.quick else 'full'} run, budget {args.budget_s:g} s")
    for part in todo:
        print(f"  {part.key:<14} " + (f"skipped: {part.skip}" if part.skip else
                                      f"cap {part.cap_s:g} s: {' '.join(part.cmd[1:])}"))
    if args.dry_run:
        return 0
    folder = Path(args.out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"bench": "multigpu", **environment(n), "quick": args.quick, "mode": mode,
           "pairs": [list(x) for x in pairs], "budget_s": args.budget_s}
    run(todo, folder, doc, args.budget_s)
    from xfer.bench.multigpu_table import markdown

    text = markdown(doc, "multigpu.json")
    (folder / "multigpu.md").write_text(text)
    print(text)
    bad = [k for k, r in doc["parts"].items() if r["status"] in ("failed", "timeout")]
    if bad:
        print(f"multigpu: failed or timed out: {', '.join(bad)} (their logs are in {folder})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
