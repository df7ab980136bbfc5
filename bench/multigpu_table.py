"""Turn a ``multigpu.json`` (``python -m xfer.bench.multigpu``) into table rows: the README's
results table (``| machine | transport and case | xfer | ceiling, same run | ratio | file |``) and
the full comparison for docs/multigpu.md, each ratio against the ceiling measured in the same call.

    python -m xfer.bench.multigpu_table bench/results/2026-12-08-h100x2-multigpu.json [--readme]

The issue's goals are checked where they apply: ``ipc`` >= 0.9 of ``cudaMemcpyPeerAsync`` back
to back (128 requests) and >= 0.8 lone, NVSHMEM direct >= 0.9 (8 back to back), and every such
transfer ahead of NCCL send/recv of the same bytes (same direction, lone against lone, back to
back against back to back). A ceiling is the benchmark's own ``peer_ceiling`` (timed in its
process after its xfer rows) where it has one, else the ``ceiling`` part's for the same pair.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["GOALS", "summarize", "readme_rows", "markdown", "main"]

GOALS = {"ipc lone": 0.8, "ipc burst": 0.9, "nvshmem direct burst": 0.9}
IPC_ROWS = {  # ipc_bench row name -> (direction, mode, label)
    "xfer write, one request end to end": ("push", "lone", "ipc write (push), one request"),
    "xfer write, 8 back to back (per request)": ("push", "burst", "ipc write (push), 8 back to back"),
    "xfer write, 128 back to back (per request)": ("push", "burst", "ipc write (push), 128 back to back"),
    "xfer read (pull), one request": ("pull", "lone", "ipc read (pull), one request"),
    "xfer read (pull), 8 back to back (per request)": ("pull", "burst", "ipc read (pull), 8 back to back"),
    "xfer read (pull), 128 back to back (per request)": ("pull", "burst", "ipc read (pull), 128 back to back"),
}
NVSHMEM_ROWS = {"write, one request end to end": ("push", "lone", "write, one request"),
                "write, 8 back to back (per request)": ("push", "burst", "write, 8 back to back"),
                "read (pull), one request": ("pull", "lone", "read (pull), one request")}


def _result(doc: dict, key: str) -> dict | None:
    rec = doc.get("parts", {}).get(key) or {}
    return rec.get("result") if rec.get("status") == "ok" else None


def _ceilings(doc: dict, pair: tuple[int, int], own: dict | None) -> tuple[dict, str]:
    """{(direction, mode): GB/s} of the pair's peer copies, and where they were timed."""
    rows, where = None, None
    if own and own.get("rows"):
        rows, where = own["rows"], "same process"
    else:
        for entry in (_result(doc, "ceiling") or {}).get("pairs", []):
            if (entry["src"], entry["dst"]) == pair and entry.get("rows"):
                rows, where = entry["rows"], "ceiling part, same call"
    return ({(r["direction"], r["mode"]): r["gb_per_s"] for r in rows or []}, where or "none")


def _ceiling_name(pair, direction: str, mode: str) -> str:
    a, b = pair
    src, dst = (a, b) if direction == "push" else (b, a)
    what = "cudaMemcpyPeerAsync" if a != b else "device copy (one GPU)"
    return f"{what} {src}->{dst}, {'lone' if mode == 'lone' else '8 back to back'}"


def _row(section, pair, what, gb, ceiling, ceiling_gb, goal=None, note=None) -> dict:
    ratio = gb / ceiling_gb if gb and ceiling_gb else None
    return {"section": section, "pair": f"{pair[0]}->{pair[1]}", "what": what, "gb_per_s": gb, "ceiling": ceiling,
            "ceiling_gb_per_s": ceiling_gb, "ratio": ratio, "goal": goal,
            "met": None if goal is None or ratio is None else ratio >= goal, "note": note}


def summarize(doc: dict) -> list[dict]:
    """Every comparison the run allows, as rows (see the module doc for the goals)."""
    pairs = [tuple(p) for p in doc.get("pairs", [])]
    if not pairs:
        return []
    pair = pairs[0]
    out: list[dict] = []
    nccl = {r["case"]: r["gb_per_s"] for r in (_result(doc, "nccl") or {}).get("rows", [])}
    ipc = _result(doc, "ipc") or {}
    ceil, where = _ceilings(doc, pair, ipc.get("peer_ceiling"))
    for r in ipc.get("rows", []):
        if r["name"] not in IPC_ROWS:
            continue
        direction, mode, label = IPC_ROWS[r["name"]]
        # the goals: lone, and the longest stream (128 back to back); 8 back to back is shown beside them
        goal = GOALS["ipc lone"] if mode == "lone" else GOALS["ipc burst"] if label.endswith(", 128 back to back") else None
        out.append(_row("ipc", pair, label, r["gb_per_s"], _ceiling_name(pair, direction, mode) + f" ({where})",
                        ceil.get((direction, mode)), goal))
        case = f"{direction} {'lone' if mode == 'lone' else 'back to back'}"
        if case in nccl and goal is not None:
            out.append(_row("ipc vs NCCL", pair, label, r["gb_per_s"], f"NCCL send/recv, {case} (same call)",
                            nccl[case], 1.0, note="ahead of NCCL when > 1"))
    nv = _result(doc, "nvshmem") or {}
    nceil, nwhere = _ceilings(doc, pair, nv.get("peer_ceiling"))
    for r in nv.get("rows", []):
        path, _, rest = r["name"].partition(": ")
        if rest not in NVSHMEM_ROWS:
            continue
        direction, mode, label = NVSHMEM_ROWS[rest]
        goal = GOALS["nvshmem direct burst"] if (path, mode) == ("direct", "burst") else None
        out.append(_row("nvshmem", pair, f"nvshmem {path}, {label}", r["gb_per_s"],
                        _ceiling_name(pair, direction, mode) + f" ({nwhere})", nceil.get((direction, mode)), goal))
        case = f"{direction} {'lone' if mode == 'lone' else 'back to back'}"
        if goal is not None and case in nccl:
            out.append(_row("nvshmem vs NCCL", pair, f"nvshmem {path}, {label}", r["gb_per_s"],
                            f"NCCL send/recv, {case} (same call)", nccl[case], 1.0, note="ahead of NCCL when > 1"))
    for case, gb in nccl.items():
        direction, _, mode = case.partition(" ")
        mode = "lone" if mode == "lone" else "burst"
        out.append(_row("nccl", pair, f"NCCL send/recv, {case}", gb, _ceiling_name(pair, direction, mode)
                        + f" ({where})", ceil.get((direction, mode))))
    for res in (_result(doc, "ucx") or {}).get("results", []):
        g = res["gb_per_s"]
        peer = "peer copy (torch copy_)" if pair[0] != pair[1] else "device copy"
        out.append(_row("ucx", pair, f"ucx write, {res['case']} (device memory)", g["xfer"], f"{peer}, same run",
                        g["copy"], note=f"xfer / ucxx contiguous send {res['xfer_vs_ucxx']:.2f}"))
    eng = _result(doc, "engine")
    if eng:
        for name, v in eng.get("variants", {}).items():
            out.append({"section": "engine", "pair": f"{pair[0]}->{pair[1]}", "what": f"engine TTFT, {name}",
                        "gb_per_s": None, "ceiling": "prefill alone (no transfer)", "ceiling_gb_per_s": None,
                        "ratio": None, "goal": None, "met": None,
                        "note": f"transfer adds {v['transfer_share_pct']:.2f} % of TTFT "
                                f"({v['added_ms']['median']:.2f} of {v['ttft_no_transfer_ms']:.2f} ms); tokens equal "
                                f"HF generate: {eng['correct_by_variant'][name]['equal']}"})
    xb = _result(doc, "xferbench")
    for w in (xb or {}).get("workloads", []):
        base = {b["name"]: b["gb_per_s"] for b in w.get("baselines", [])}
        for run in w.get("runs", []):
            res = run.get("result")
            if res:
                out.append(_row("xfer-bench", pair, f"xfer-bench {res['name']}", res["gb_per_s"],
                                f"{res['ceiling']}, same run", base.get(res["ceiling"]),
                                note=f"NCCL send/recv {base['NCCL send/recv']:.0f} GB/s"
                                if "NCCL send/recv" in base else None))
    return out


def _gb(x) -> str:
    return "-" if x is None else f"{x:,.0f} GB/s" if x >= 10 else f"{x:.2f} GB/s"


def _machine(doc: dict) -> str:
    pair = doc["pairs"][0]
    name = doc.get("device") or "GPU"
    if pair[0] == pair[1]:
        return f"{name}, two processes on one GPU"
    return f"{name} x{doc.get('gpus')}, GPU {pair[0]} -> GPU {pair[1]}"


def readme_rows(doc: dict, file: str) -> list[str]:
    """The headline rows in the README's results table format."""
    pick = {"ipc write (push), 128 back to back", "ipc write (push), one request", "ipc read (pull), one request",
            "ipc read (pull), 128 back to back", "nvshmem direct, write, 8 back to back",
            "NCCL send/recv, push back to back"}
    out = []
    for r in summarize(doc):
        if r["section"] in ("ipc", "nvshmem", "nccl") and r["what"] in pick and r["ratio"] is not None:
            ratio = f"**{r['ratio']:.2f}**" if r["goal"] else f"{r['ratio']:.2f}"
            out.append(f"| {_machine(doc)} | {r['what']}, seed 512 MiB (32 KiB slices) | {_gb(r['gb_per_s'])} | "
                       f"{r['ceiling']}, {_gb(r['ceiling_gb_per_s'])} | {ratio} | `{file}` |")
    return out


def markdown(doc: dict, file: str) -> str:
    """The README rows, every comparison, and what each part did."""
    if not doc.get("pairs"):
        return "no GPU: nothing was measured\n"
    lines = [f"## {_machine(doc)}, {doc.get('date', '?')[:10]} ({'quick' if doc.get('quick') else 'full'} run)", "",
             "README rows:", "", "| machine | transport and case | xfer | ceiling, same run | ratio | file |",
             "| --- | --- | --- | --- | --- | --- |", *readme_rows(doc, file), "",
             "| pair | what | xfer | against | its figure | ratio | goal | met | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summarize(doc):
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        goal = "-" if r["goal"] is None else f">= {r['goal']:g}"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['pair']} | {r['what']} | {_gb(r['gb_per_s'])} | {r['ceiling']} | "
                     f"{_gb(r['ceiling_gb_per_s'])} | {ratio} | {goal} | {met} | {r['note'] or ''} |")
    probe = _result(doc, "p2p")
    if probe:
        lines += ["", f"How a copy on GPU {probe['local']} reaches GPU {probe['peer']}'s CUDA-IPC-mapped cache "
                      "(bench/p2p_probe.py):", "", "| peer's allocator | mapping | pull | push | pull GB/s | error |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for v in probe.get("variants", []):
            yes = (lambda k: "-" if k not in v else "ok" if v[k] else "**wrong**")  # noqa: E731
            lines.append(f"| {v.get('allocation')} | {v.get('variant', '-')} | {yes('pull_ok')} | {yes('push_ok')} | "
                         f"{_gb(v.get('pull_gb_per_s'))} | {v.get('skipped') or v.get('error') or ''} |")
    lines += ["", "| part | status | s | note |", "| --- | --- | --- | --- |"]
    for key, rec in doc.get("parts", {}).items():
        note = rec.get("reason") or ""
        if key == "tests" and rec.get("counts"):
            note = ", ".join(f"{v} {k}" for k, v in rec["counts"].items())
        elif rec.get("status") in ("failed", "timeout"):
            note = (rec.get("log_tail") or "").strip().splitlines()[-1:][0][:160] if rec.get("log_tail") else ""
        lines.append(f"| {key} | {rec.get('status')} | {rec.get('wall_s', '-')} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="xfer-multigpu-table", description=__doc__.splitlines()[0])
    p.add_argument("json", help="a multigpu.json")
    p.add_argument("--readme", action="store_true", help="only the README rows")
    p.add_argument("--file", help="the file name the rows cite (default: the JSON's name)")
    args = p.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    file = args.file or Path(args.json).name
    print("\n".join(readme_rows(doc, file)) if args.readme else markdown(doc, file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
