"""Serving metrics from request results: TTFT, TPOT and the KV-transfer share of TTFT.

Times are ``time.time()`` stamps taken in different processes of one host (``arrival`` by the
router, ``prefill_start``/``forward`` by the prefill instance, ``ready`` and token times by the
decode instance); across hosts they need synchronised clocks.
"""

from __future__ import annotations

import statistics

__all__ = ["request_metrics", "summarize"]


def request_metrics(r: dict) -> dict:
    """ttft: arrival -> first token usable at decode (KV landed); transfer: prefill forward done -> ready
    (the transfer not hidden behind the forward); tpot: mean time per later token."""
    ttft = r["ready"] - r["arrival"]
    times = r["token_times"]
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    transfer = max(0.0, r["ready"] - r["forward"])
    return {"ttft_s": ttft, "tpot_s": tpot, "transfer_s": transfer, "prefill_s": r["forward"] - r["prefill_start"],
            "queue_s": r["prefill_start"] - r["arrival"], "transfer_share": transfer / ttft if ttft > 0 else 0.0}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(results: list[dict]) -> dict:
    """Medians and p99s over ``results`` (each a decode instance's result dict)."""
    rows = [request_metrics(r) for r in results]
    out = {"requests": len(rows)}
    for key in ("ttft_s", "tpot_s", "transfer_s", "prefill_s", "queue_s", "transfer_share"):
        xs = [row[key] for row in rows]
        out[f"{key}_p50"] = statistics.median(xs)
        out[f"{key}_p99"] = _pct(xs, 0.99)
    out["swaps"] = sum(r.get("swaps", 0) for r in results)
    out["swap_s"] = sum(r.get("swap_s", 0.0) for r in results)
    return out
