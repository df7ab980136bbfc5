"""Running xfer-bench's roles: the target, and the initiator (local, across nodes, or under a
launcher) with its session: plan, sweep, table, JSON, plot, exit status."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import sys
from pathlib import Path

from .errors import BenchError, Exit
from .remote import (CLAIM_KEY, TARGET_KEY, Channel, LocalTarget, dist_env, local_addr_toward, parse_hostport,
                     store_url, wait_key)

__all__ = ["setup_threads", "run_target", "run_initiator", "version"]

STORE_PREFIX = "xfer-bench/"


def setup_threads(device) -> None:
    import torch

    # torch's OpenMP threads spin between ops; on a small shared CPU host they steal the cores the
    # copies need (10x slower indexing measured on 2 cores). The user's OMP_NUM_THREADS wins.
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _unavailable_here(transports: list[str]) -> dict[str, str]:
    """Why each pinned transport cannot run in this process (an empty dict when any can, or auto)."""
    from xfer.transports import TransportKind, load

    reasons = {}
    for t in transports:
        if t == "auto":
            return {}
        cls = load(TransportKind(t))
        why = cls if isinstance(cls, str) else cls.probe()
        if why is None and t == "nvshmem":
            why = "nvshmem: xfer-bench does not form NVSHMEM groups yet (bench/nvshmem_bench.py does)"
        if why is None:
            return {}
        reasons[t] = why
    return reasons


def _log(args):
    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)
    return log


# ---- roles --------------------------------------------------------------------------------------
def _reachable(url: str, timeout: float, what: str) -> None:
    """Wait until something accepts TCP connections at a tcp:// store URL (retrying until
    ``timeout``): a plain socket says "refused" or "timed out" in one line, where TCPStore's
    client would print C++ stack traces on every retry."""
    import time

    if not url.startswith("tcp://"):
        return
    host, port = parse_hostport(url.removeprefix("tcp://"), "store URL", allow_zero=True)
    if port == 0:
        return
    deadline, err = time.monotonic() + timeout, None
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))).close()
            return
        except OSError as e:
            err = e
        if left <= 0:
            raise BenchError(f"{what}: nothing accepted a connection at {host}:{port} within {timeout:g} s "
                             f"(last: {err.strerror or err})", Exit.UNREACHABLE)
        time.sleep(min(0.25, max(0.0, left)))


def _open(url: str, *, host: bool, timeout: float, prefix: str, what: str, host_if_missing: bool = False):
    """Open the store at ``url``: ``host=True`` hosts it or fails (joining someone else's store on
    that port would be a silent mistake); otherwise join it, hosting it if ``host_if_missing``."""
    if not host and not host_if_missing:
        _reachable(url, timeout, what)
    from xfer.errors import StoreError
    from xfer.store import TCPStoreBackend, open_store

    try:
        if host:
            h, port = parse_hostport(url.removeprefix("tcp://"), "--listen")
            return TCPStoreBackend(h, port, is_host=True, timeout=timeout, prefix=prefix)
        return open_store(url, timeout=timeout, prefix=prefix, host_if_missing=host_if_missing)
    except StoreError as e:
        raise BenchError(f"{what}: {e}", Exit.ERROR if host else Exit.UNREACHABLE) from None


def _url_host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname or "127.0.0.1"


def run_target(args, device) -> int:
    """Serve one initiator on the store named by --store, --listen or the launcher; the exit status."""
    env = dist_env()
    log = _log(args)
    if args.store:
        store = _open(args.store, host=False, timeout=args.connect_timeout, prefix=STORE_PREFIX,
                      what=f"cannot reach the store {args.store}")
        bind = args.bind or local_addr_toward(_url_host(args.store))
    elif args.listen:
        host, port = parse_hostport(args.listen, "--listen")
        store = _open(store_url(host, port), host=True, timeout=args.connect_timeout, prefix=STORE_PREFIX,
                      what=f"cannot listen on {args.listen}")
        bind = args.bind or host
    else:
        url = store_url(env.host, env.port)
        bind = args.bind or local_addr_toward(env.host)
        store = _open(url, host=False, timeout=args.connect_timeout, prefix=env.prefix,
                      host_if_missing=not env.agent_store, what=f"cannot open the {env.source} store at {url}")
    setup_threads(device)
    from .target import serve

    try:
        return serve(store, device, bind, args.idle_timeout, log)
    finally:
        store.close()


def _await_target(store, timeout: float, alive, where: str) -> dict:
    from xfer.errors import StoreError

    try:
        return json.loads(wait_key(store, TARGET_KEY, timeout, alive, f"waiting for it to register at {where}"))
    except StoreError as e:
        raise BenchError(f"lost the store at {where}: {e}", Exit.UNREACHABLE) from None


def run_initiator(args, role: str, device, peer_device, workloads) -> int:
    """Start or reach the target, run the sweep, report; the exit status. ``peer_device``: the
    local target's device (local role only)."""
    setup_threads(device)
    if blocked := _unavailable_here(args.transport):  # before starting or reaching a target
        raise BenchError("no requested transport can run here: " + " | ".join(blocked.values()), Exit.NO_TRANSPORT)
    env, child, alive = dist_env(), None, None
    if role == "local":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # both processes here: keep UCX off the other NICs
        peer_dev = str(peer_device)
        store = _open("tcp://127.0.0.1:0", host=False, timeout=args.connect_timeout, prefix=STORE_PREFIX,
                      what="cannot host a store on loopback")
        extra = {} if "OMP_NUM_THREADS" in os.environ or not peer_dev.startswith("cpu") else {"OMP_NUM_THREADS": "1"}
        child = LocalTarget(store.endpoint, peer_dev, extra, max(args.timeout, args.idle_timeout))
        alive, where, bind, mode = child.why_dead, "a local child process", "127.0.0.1", "local"
    elif args.peer or args.store:
        url = args.store or store_url(*parse_hostport(args.peer, "--peer"))
        where = args.peer or args.store
        store = _open(url, host=False, timeout=args.connect_timeout, prefix=STORE_PREFIX,
                      what=f"cannot reach the xfer-bench target at {where} (is `xfer-bench --role target "
                           f"--listen {where}` running there?)")
        peer_host = parse_hostport(args.peer, "--peer")[0] if args.peer else _url_host(args.store)
        bind, mode = args.bind or local_addr_toward(peer_host), "cross-node"
    else:
        where = store_url(env.host, env.port)
        store = _open(where, host=False, timeout=args.connect_timeout, prefix=env.prefix,
                      what=f"cannot reach rank 0's store at {where}")
        bind, mode = args.bind or local_addr_toward(env.host), env.source
    channel = Channel(store, alive)
    try:
        if store.add(CLAIM_KEY, 1) != 1:
            raise BenchError(f"the xfer-bench target at {where} already serves another initiator", Exit.UNREACHABLE)
        info = _await_target(store, args.connect_timeout + (30 if child else 0), alive, where)
        try:
            status = _session(args, store, channel, info, bind, mode, device, workloads)
        except BaseException as e:  # interrupted or failed: release the target, unless it is gone
            if not (isinstance(e, BenchError) and e.code == Exit.UNREACHABLE):
                _stop(channel)
            raise
        _stop(channel)
        return status
    finally:
        if child is not None:
            child.close()
        store.close()


def _stop(channel) -> None:
    try:
        channel.call("stop", 15)
    except BenchError:
        pass


def _session(args, store, channel, info, bind, mode, device, workloads) -> int:
    import torch

    from .report import Progress, table, write_results
    from .sweep import Initiator, Plan
    from .target import describe_device

    log = _log(args)
    baselines = None if args.baselines == "auto" else (() if args.baselines == "none" else tuple(args.baselines))
    plan = Plan(workloads=tuple(workloads), transports=tuple(args.transport), chunks=tuple(args.chunk_bytes or [None]),
                baselines=baselines, iters=args.iters, budget_s=args.max_seconds, timeout_s=args.timeout)
    progress = Progress(plan.steps, enabled=not args.quiet)
    started = dt.datetime.now(dt.timezone.utc)
    init = Initiator(channel, store, device, info, bind, progress, log)
    try:
        records = init.run(plan)
    finally:
        init.close()
        progress.finish()
    doc = {
        "schema": "xfer-bench/1", "tool": "xfer-bench", "xfer_version": version("xfer"),
        "date": started.isoformat(timespec="seconds"), "mode": mode,
        "command": sys.argv[1:] if args.argv is None else list(args.argv),
        "initiator": {"host": socket.gethostname(), "bind": bind, "cpu_count": os.cpu_count(),
                      "torch_threads": torch.get_num_threads(), **describe_device(device)},
        "target": {k: info.get(k) for k in ("host", "bind", "pid", "device", "device_name", "device_uuid")},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "ucxx": version("ucxx-cu12") or version("ucxx-cu13"), "nvshmem4py": version("nvshmem4py-cu13")},
        "settings": {"preset": args.preset, "transports": list(plan.transports), "chunk_bytes": list(plan.chunks),
                     "baselines": args.baselines, "iters": plan.iters, "max_seconds": plan.budget_s,
                     "timeout_s": plan.timeout_s, "fit": not args.no_fit},
        "verified": all(r["verified"] for rec in records for r in rec["runs"] if r["status"] != "skipped")
        and any(r["status"] == "ok" for rec in records for r in rec["runs"]),
        "workloads": records,
    }
    folder = Path(args.out) / f"{started:%Y%m%d-%H%M%S}-{socket.gethostname()}-{device.type}"
    doc["results_dir"] = str(folder)
    text = table(doc)
    paths = write_results(doc, folder, text)
    if not args.no_plots:
        from .plot import plot

        more, note = plot(doc, folder)
        paths += more
        if note:
            log(note)
    out = getattr(args, "stdout", None) or sys.stdout  # the CLI's own stdout: libraries print to stderr
    print(json.dumps(doc, indent=1) if args.json else text, file=out, flush=True)
    names = ", ".join(x.name for x in paths)
    where = f"\nresults: {folder}/ ({names})"
    if args.json:
        log(where)
    else:
        print(where, file=out, flush=True)
    return _status(doc)


def _status(doc: dict) -> int:
    def log(msg: str) -> None:  # errors are printed even with --quiet
        print(msg, file=sys.stderr, flush=True)

    runs = [(rec["workload"], r) for rec in doc["workloads"] for r in rec["runs"]]
    bad = [r for _, r in runs if r["verified"] is False]
    if bad:
        log(f"xfer-bench: error: {len(bad)} run(s) moved wrong bytes: {bad[0]['reason']}")
        return Exit.UNVERIFIED
    if not any(r["status"] == "ok" for _, r in runs):
        reasons = sorted({r["reason"] for _, r in runs})
        log("xfer-bench: error: no requested transport can serve this pair: " + " | ".join(reasons))
        return Exit.NO_TRANSPORT
    failed = [r for _, r in runs if r["status"] == "failed"]
    if failed:
        log(f"xfer-bench: error: {len(failed)} run(s) failed: {failed[0]['reason']}")
        return Exit.ERROR
    return Exit.OK


def version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
