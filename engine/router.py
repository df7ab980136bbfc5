"""The router: starts N prefill and M decode instances, each its own process, wires them through the
metadata store it hosts, spreads requests over them and collects the results.

Processes fork from a forkserver that has imported torch, transformers and xfer once
(``worker`` is its preload), so starting four instances costs one import, not four. For instances
on other hosts, run ``worker.run`` there with the router's ``store.endpoint``.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict

from xfer.errors import StoreTimeoutError, XferError
from xfer.store import open_store

from .config import ModelSpec, PoolSpec, WaitMode
from .protocol import Request, send

__all__ = ["Router", "WorkerFailedError", "prestart"]


class WorkerFailedError(XferError):
    """An instance process died or reported an error; the message carries its traceback."""


def prestart() -> None:
    """Start the forkserver now (it imports torch and transformers in the background)."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["xfer.engine.worker"])
    return ctx


class Router:
    """``num_prefill`` prefill + ``num_decode`` decode processes on this host.

    ``prefill_tp`` > 1: each prefill instance is a tensor-parallel group of that many rank
    processes (``<name>``, ``<name>.r1``, ...; ``tp`` module), each streaming its kv-head slice
    into the decode instances' blocks, which join the slices.

    Requests go to decode instances round-robin (each admits when its blocks fit and queues
    otherwise: back-pressure) with a prefill instance chosen round-robin. Use as a context manager:
    ``close`` stops every process it started.
    """

    def __init__(self, model: ModelSpec, *, num_prefill: int = 1, num_decode: int = 1,
                 prefill_pool: PoolSpec | None = None, decode_pool: PoolSpec | None = None,
                 wait: WaitMode = WaitMode.REQUEST, swap_blocks: int = 0, lease_s: float = 30.0,
                 threads: int = 1, start_timeout_s: float = 120.0, store_url: str = "tcp://127.0.0.1:0",
                 prefill_tp: int = 1, decode_max_batch: int = 64):
        prefill_pool, decode_pool = prefill_pool or PoolSpec(), decode_pool or PoolSpec()
        self.store = open_store(store_url)
        shards = []
        if prefill_tp > 1:
            from .tp import shard_heads

            shards = [shard_heads(model.num_kv_heads, r, prefill_tp) for r in range(prefill_tp)]
        self.cfg = {"model": model.to_dict(), "prefill_pool": prefill_pool.to_dict(),
                    "decode_pool": decode_pool.to_dict(), "wait": WaitMode(wait).value,
                    "swap_blocks": swap_blocks, "lease_s": lease_s, "threads": threads, "tp": prefill_tp,
                    "shards": shards, "max_batch": decode_max_batch}
        self.prefills = [f"prefill-{i}" for i in range(num_prefill)]  # instances, or TP group leaders (rank 0)
        ranks = {f"{p}.r{r}": {"tp_rank": r, "tp_leader": p} for p in self.prefills for r in range(1, prefill_tp)}
        ranks.update({p: {"tp_rank": 0, "tp_leader": p} for p in self.prefills})
        self.decodes = [f"decode-{i}" for i in range(num_decode)]
        self.procs: dict[str, mp.Process] = {}
        self._closed = False
        self._next_p, self._next_d = itertools.cycle(self.prefills), itertools.cycle(self.decodes)
        ctx = _context()
        try:
            for name in [*sorted(ranks), *self.decodes]:
                role = "prefill" if name in ranks else "decode"
                proc = ctx.Process(target=_worker_entry, args=(role, name, self.store.endpoint,
                                                               {**self.cfg, **ranks.get(name, {})}),
                                   name=name, daemon=True)
                proc.start()
                self.procs[name] = proc
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in self.procs:
            while self.store.try_get(f"ready/{name}") is None:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise WorkerFailedError(f"instance {name!r} not ready within {timeout:g} s")
                time.sleep(0.02)

    def check_alive(self) -> None:
        """Raise :class:`WorkerFailedError` with the traceback of any instance that failed."""
        for name, proc in self.procs.items():
            err = self.store.try_get(f"error/{name}")
            if err is not None or not proc.is_alive():
                detail = err.decode() if err else f"exit code {proc.exitcode}"
                raise WorkerFailedError(f"instance {name!r} failed: {detail}")

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Send ``req`` to the next decode instance (stamping arrival and the prefill instance)."""
        req.arrival = req.arrival or time.time()
        req.prefill = req.prefill or next(self._next_p)
        send(self.store, next(self._next_d), {"type": "request", **asdict(req)})

    def result(self, req_id: str, timeout: float = 60.0) -> dict:
        """The result of ``req_id`` (tokens and time stamps), waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return json.loads(self.store.get(f"result/{req_id}", 1.0))
            except StoreTimeoutError:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise StoreTimeoutError(f"no result for request {req_id!r} within {timeout:g} s") from None

    def run(self, requests: list[Request], rate: float | None = None, timeout: float = 120.0,
            total_timeout: float | None = None) -> list[dict]:
        """Submit ``requests`` at ``rate`` per second (Poisson arrivals; None: all at once); their results.

        ``timeout``: seconds to wait for each result; ``total_timeout``: for all of them, from the first submit.
        """
        import random

        rng = random.Random(0)
        start = time.time()
        at = 0.0
        for req in requests:
            if rate:
                at += rng.expovariate(rate)
                time.sleep(max(0.0, start + at - time.time()))
            self.submit(req)
        if total_timeout is None:
            return [self.result(r.id, timeout) for r in requests]
        end = start + total_timeout
        return [self.result(r.id, max(0.0, min(timeout, end - time.time()))) for r in requests]

    def info(self, name: str) -> dict:
        """What instance ``name`` published at start (a prefill rank: its kv-heads, TP rank and backend)."""
        return json.loads(self.store.try_get(f"info/{name}") or b"{}")

    def stats(self) -> dict:
        """Per decode instance: swaps and seconds spent swapping (available after ``close``)."""
        return {n: json.loads(self.store.try_get(f"stats/{n}") or b"{}") for n in self.decodes}

    def close(self, timeout: float = 10.0) -> None:
        """Stop every instance: a stop message, then SIGKILL for any still alive after ``timeout``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for name, proc in self.procs.items():
            if proc.is_alive():
                try:
                    send(self.store, name, {"type": "stop"})
                except XferError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)

    def shutdown(self) -> None:
        """``close`` and release the store (results and stats can no longer be read)."""
        self.close()
        if not self.store.closed:
            self.store.close()


def _worker_entry(role: str, name: str, store_url: str, cfg: dict) -> None:
    from .worker import run

    run(role, name, store_url, cfg)
