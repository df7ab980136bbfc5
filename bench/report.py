"""What xfer-bench shows: the progress bar while it runs, the table at the end, the results folder."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .presets import fmt_bytes

__all__ = ["Progress", "table", "write_results"]


class Progress:
    """A one-line bar on a terminal (stderr), one line per step otherwise; silent when disabled."""

    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.stream = stream or sys.stderr
        self.tty = self.enabled and self.stream.isatty()
        self.start = time.monotonic()

    def _line(self, label: str) -> str:
        width = 24
        filled = int(width * min(self.done, self.total) / self.total)
        return f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {time.monotonic() - self.start:5.0f} s  {label}"

    def step(self, label: str, extra: int = 0) -> None:
        self.done += 1 + extra
        self.total = max(self.total, self.done)
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self._line(label)[:118].ljust(118))
        else:
            self.stream.write(self._line(label) + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r" + " " * 118 + "\r" if self.tty else "") + text + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            self.done = self.total
            self.stream.write("\r" + self._line("done")[:118].ljust(118) + "\n")
            self.stream.flush()


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _row_line(r: dict) -> str:
    ratio = "-" if r["ratio_to_ceiling"] is None else f"{r['ratio_to_ceiling']:.2f}"
    name = r["name"] + (" (ceiling)" if r["kind"] == "ceiling" else "")
    return (f"  {name:<36}{r['gb_per_s']:>8.3g}{ratio:>10}{r['slices_per_s']:>11.3g}{r['p50_ms']:>9.3g}"
            f"{r['p99_ms']:>9.3g}{_num(r['post_us'], '.0f'):>9}{_num(r['post_cpu_us'], '.0f'):>9}{r['n']:>4}")


HEADER = (f"  {'what':<36}{'GB/s':>8}{'x ceil':>10}{'slices/s':>11}{'p50 ms':>9}{'p99 ms':>9}{'post µs':>9}"
          f"{'cpu µs':>9}{'n':>4}")


def table(doc: dict) -> str:
    i, t = doc["initiator"], doc["target"]
    out = [f"xfer-bench {doc['xfer_version']}  {doc['date']}  mode {doc['mode']}",
           f"initiator   {i['host']}  {i['device']} ({i['device_name']})  torch {doc['versions']['torch']}, "
           f"{i['torch_threads']} torch thread(s)",
           f"target      {t['host']}  {t['device']} ({t['device_name']})  at {t['bind']}"]
    n = len(doc["workloads"])
    for k, rec in enumerate(doc["workloads"]):
        w = rec["workload"]
        kv = "K/V" if w["num_kv"] == 2 else "latent"
        out += ["", f"workload {k + 1}/{n}  {w['preset']} {w['layout']}: {w['num_layers']} layers x {kv} x "
                f"{w['blocks_moved']} of {w['num_blocks']} blocks, {fmt_bytes(w['slice_bytes'])} slices "
                f"({w['slices']:,} slices, {fmt_bytes(w['payload_bytes'])})"]
        if w["fitted"]:
            out.append(f"  fitted    {w['fitted']}")
        for r in rec["runs"]:
            what = "transport " + r["transport"] + (f", chunk {fmt_bytes(r['chunk_bytes'])}" if r["chunk_bytes"] else "")
            if r["route"] is None:
                out.append(f"  {what}: {r['status']}: {r['reason']}")
                continue
            out.append(f"  {what} -> {r['route']['kind']}: {r['route']['reason']}")
            if r["status"] == "ok":
                out.append("            verified: every destination byte equals the source (before and after "
                           "timing); all other blocks untouched")
            else:
                out.append(f"            {r['status'].upper()}: {r['reason']}")
        out += ["", HEADER]
        rows = ([b for b in rec["baselines"] if b["kind"] == "ceiling"] + [r["result"] for r in rec["runs"] if r["result"]]
                + [b for b in rec["baselines"] if b["kind"] != "ceiling"])
        out += [_row_line(r) for r in rows]
        for name, why in rec["skipped_baselines"].items():
            out.append(f"  ({name}: not measured: {why})")
    if n > 1:
        out += ["", summary(doc)]
    out += ["", "GB/s and slices/s from the median (contiguous rows: the same bytes); x ceil = the route's ceiling "
            "time / this time;", "post µs / cpu µs = wall and thread-CPU time of the write() call alone; "
            "n = timed rounds after one warm-up."]
    return "\n".join(out)


def summary(doc: dict) -> str:
    """GB/s of every series (rows) for every workload (columns w1, w2, ...)."""
    series: dict[str, dict[int, float]] = {}
    lines = ["summary, GB/s by workload:"]
    for k, rec in enumerate(doc["workloads"]):
        w = rec["workload"]
        lines.append(f"  w{k + 1} = {w['layout']}, {fmt_bytes(w['slice_bytes'])} slices x {w['blocks_moved']} blocks"
                     f" x {w['num_layers']} layers")
        for r in [x["result"] for x in rec["runs"] if x["result"]] + rec["baselines"]:
            series.setdefault(r["name"], {})[k] = r["gb_per_s"]
    cols = range(len(doc["workloads"]))
    lines.append(f"  {'':<36}" + "".join(f"{'w' + str(k + 1):>9}" for k in cols))
    for name, cells in series.items():
        lines.append(f"  {name:<36}" + "".join(f"{_num(cells.get(k), '.3g'):>9}" for k in cols))
    return "\n".join(lines)


def write_results(doc: dict, folder: Path, text: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "results.json", folder / "table.txt"]
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    paths[1].write_text(text + "\n")
    return paths
