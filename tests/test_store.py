"""Metadata store: both backends (TCPStore hosted here, a real etcd on loopback) behind one fixture."""

import hashlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest

from xfer.errors import InvalidArgumentError, StoreError, StoreTimeoutError
from xfer.store import EtcdStore, TCPStoreBackend, open_store

from fence_helpers import freeze

try:
    import etcd3gw  # noqa: F401

    _ETCD3GW = True
except ImportError:
    _ETCD3GW = False
ETCD_BIN = shutil.which("etcd")
BLOB = bytes(range(256)) * 1200  # 307,200 bytes, every byte value, 1,200 NULs
SLACK = 1.0  # seconds a timeout may overrun on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_etcd(data_dir):
    """A one-member etcd on loopback; returns (process, URL) once it answers /health."""
    if ETCD_BIN is None:
        pytest.skip("no etcd binary on PATH (Debian package etcd-server)")
    if not _ETCD3GW:
        pytest.skip("the etcd store needs etcd3gw: pip install -e '.[etcd]'")
    client, peer = free_port(), free_port()
    log_path = data_dir / "etcd.log"
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    cmd = [ETCD_BIN, "--name", "t", "--data-dir", str(data_dir / "data"),
           "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
           "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
           "--initial-cluster", f"t={peer_url}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never a proxy
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with no_proxy.open(f"http://127.0.0.1:{client}/health", timeout=0.5) as r:
                if b'"true"' in r.read():
                    return proc, f"etcd://127.0.0.1:{client}"
        except OSError:
            time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"etcd did not come up; log tail:\n{log_path.read_text()[-2000:]}")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory):
    proc, url = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield url
    stop(proc)


@pytest.fixture(params=["tcp", "etcd"])
def store(request):
    """A peer's store: for tcp, connected to a host made here; for etcd, a fresh key prefix."""
    if request.param == "tcp":
        with open_store("tcp://127.0.0.1:0", timeout=5) as host, open_store(host.endpoint, timeout=5) as peer:
            assert not peer.is_host and peer.port == host.port
            yield peer
    else:
        url = request.getfixturevalue("etcd_url")
        with open_store(url, timeout=5, prefix=f"test-{uuid.uuid4().hex}/") as peer:
            yield peer


def test_round_trip_binary(store):
    store.set("blob", BLOB)
    assert store.get("blob", timeout=5) == BLOB and store.try_get("blob") == BLOB
    store.set("blob", bytearray(b"\x00\x01\x00"))  # overwrite, bytes-like
    assert store.get("blob", 5) == b"\x00\x01\x00"
    store.set("empty", b"")
    assert store.try_get("empty") == b"" and store.get("empty", 1) == b""


def test_get_waits_for_a_later_set_from_another_thread(store):
    def later():
        time.sleep(0.3)
        store.set("late", BLOB)  # the same store object the main thread is waiting on

    t0 = time.monotonic()
    setter = threading.Thread(target=later)
    setter.start()
    value = store.get("late", timeout=10)
    elapsed = time.monotonic() - t0
    setter.join()
    assert value == BLOB
    assert 0.3 <= elapsed < 0.3 + SLACK, elapsed  # woke on the set, not on the timeout


def test_get_timeout_raises_in_time(store):
    assert store.try_get("never") is None
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as ei:
        store.get("never", timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 0.5 + SLACK, elapsed
    assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, StoreError)
    assert "never" in str(ei.value) and "0.5 s" in str(ei.value) and store.endpoint in str(ei.value)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        store.get("never", timeout=0)
    assert time.monotonic() - t0 < SLACK


def test_delete(store):
    store.set("k", b"v")
    assert store.delete("k") is True
    assert store.try_get("k") is None
    assert store.delete("k") is False
    with pytest.raises(StoreTimeoutError):  # a deleted key is not seen by a later wait
        store.get("k", timeout=0.3)
    store.set("k", b"w")
    assert store.get("k", 1) == b"w"


def test_add_counter_from_threads(store):
    got, threads = [], 4

    def bump():
        for _ in range(10):
            got.append(store.add("rank", 1))

    workers = [threading.Thread(target=bump) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(got) == list(range(1, 41))  # every caller got a distinct rank
    assert store.add("rank", 0) == 40 and store.add("rank", -10) == 30
    assert store.get("rank", 1) == b"30"


def test_add_to_non_integer_raises_and_store_stays_usable(store):
    store.set("text", b"abc")
    with pytest.raises(StoreError, match="not an integer") as ei:
        store.add("text", 1)
    assert "text" in str(ei.value) and store.endpoint in str(ei.value)
    store.set("after", b"ok")
    assert store.get("after", 1) == b"ok" and store.add("n", 5) == 5


def test_second_process_reads_by_url(store):
    child = (
        "import hashlib, sys\n"
        "from xfer.store import open_store\n"
        "with open_store(sys.argv[1], prefix=sys.argv[2], timeout=10) as s:\n"
        "    v = s.get('from-parent', timeout=20)\n"
        "    s.set('from-child', hashlib.sha256(v).hexdigest().encode())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, store.endpoint, store.prefix],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        store.set("from-parent", BLOB)  # the child may not be up yet: it waits for the key
        reply = store.get("from-child", timeout=25)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert reply == hashlib.sha256(BLOB).hexdigest().encode()


def test_prefix_namespaces_keys(store):
    other = open_store(store.endpoint, timeout=5, prefix=store.prefix + "other/")
    bare = open_store(store.endpoint, timeout=5, prefix="")
    with other, bare:
        store.set("k", b"mine")
        assert other.try_get("k") is None
        assert bare.try_get(store.prefix + "k") == b"mine"


def test_close_is_idempotent_and_final(store):
    assert "open" in repr(store) and store.endpoint in repr(store)
    store.close()
    store.close()
    assert store.closed and "closed" in repr(store)
    with pytest.raises(StoreError, match="closed") as ei:
        store.get("k", 1)
    assert "k" in str(ei.value)


def test_invalid_arguments(store):
    for bad_key in ("", None, 3):
        with pytest.raises(InvalidArgumentError):
            store.try_get(bad_key)
    with pytest.raises(InvalidArgumentError, match="must be bytes"):
        store.set("k", "text")
    for bad_timeout in (-1, float("nan"), float("inf"), "1"):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            store.get("k", bad_timeout)
    with pytest.raises(InvalidArgumentError):
        store.add("k", 1.5)


@pytest.mark.parametrize("backend", ["tcp", "etcd"])
def test_server_gone_becomes_store_error(backend, tmp_path):
    if backend == "tcp":
        host = open_store("tcp://127.0.0.1:0", timeout=2)
        peer = open_store(host.endpoint, timeout=2)
        kill = host.close
    else:
        proc, url = start_etcd(tmp_path)
        peer = open_store(url, timeout=2)
        kill = lambda: stop(proc)  # noqa: E731
    try:
        peer.set("k", b"v")
        kill()
        with pytest.raises(StoreError) as ei:
            peer.try_get("k")
        assert type(ei.value) is StoreError and ei.value.__cause__ is not None
        assert "k" in str(ei.value) and peer.endpoint in str(ei.value)
    finally:
        kill()
        peer.close()


def test_tcp_port_zero_reports_bound_port():
    with open_store("tcp://127.0.0.1:0") as host:
        assert isinstance(host, TCPStoreBackend) and host.is_host and host.port > 0
        assert host.endpoint == f"tcp://127.0.0.1:{host.port}"
        assert "host" in repr(host)
        with socket.create_connection(("127.0.0.1", host.port), timeout=2):
            pass  # something listens there


def test_tcp_host_if_missing_hosts_once_then_connects():
    url = f"tcp://127.0.0.1:{free_port()}"
    with open_store(url, host_if_missing=True, timeout=5) as first, \
            open_store(url, host_if_missing=True, timeout=5) as second:
        assert first.is_host and not second.is_host
        first.set("who", b"first")
        assert second.get("who", 2) == b"first"


def test_tcp_connect_to_nobody_raises_store_error():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        open_store(f"tcp://127.0.0.1:{port}", timeout=0.3)
    assert time.monotonic() - t0 < 0.3 + 3 * SLACK  # TCPStore retries once after a back-off


def test_etcd_unreachable_raises_store_error():
    if not _ETCD3GW:
        pytest.skip("the etcd store needs etcd3gw: pip install -e '.[etcd]'")
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=f"cannot reach etcd at etcd://127.0.0.1:{port}"):
        open_store(f"etcd://127.0.0.1:{port}", timeout=0.5)
    assert time.monotonic() - t0 < 0.5 + SLACK


def test_etcd_without_etcd3gw_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "etcd3gw", None)  # makes `import etcd3gw` raise ImportError
    with pytest.raises(StoreError, match=r"pip install xfer\[etcd\]"):
        EtcdStore("127.0.0.1", 2379)


@pytest.mark.parametrize("url", [
    "", "127.0.0.1:5000", "tcp://", "tcp://127.0.0.1", "tcp://:5000", "http://127.0.0.1:5000",
    "tcp://127.0.0.1:99999", "tcp://127.0.0.1:port", "tcp://127.0.0.1:5000/path", "tcp://u@127.0.0.1:5000",
    "etcd://127.0.0.1:0", "etcd://127.0.0.1", None,
])
def test_bad_url(url):
    with pytest.raises(InvalidArgumentError) as ei:
        open_store(url, timeout=1)
    msg = str(ei.value)
    assert repr(url) in msg and "tcp://HOST:PORT" in msg and "etcd://HOST:PORT" in msg


def test_agents_rendezvous_by_name_and_move_verified_blocks(store):
    """Two agents find each other through the store (either backend) and move blocks."""
    from helpers import assert_blocks_equal, assert_untouched, fill_random, poison
    from xfer import Agent, LayoutKind, make_kv_cache

    dims = dict(num_layers=2, num_blocks=6, block_size=2, num_heads=2, head_dim=4)
    ta, la = make_kv_cache(LayoutKind.VLLM_FLASHINFER, **dims)
    tb, lb = make_kv_cache(LayoutKind.VLLM_FLASHINFER, **dims)
    fill_random(ta, seed=5)
    poison(tb)
    with Agent("prefill-r") as a, Agent("decode-r") as b:
        a.register("kv", ta, la)
        b.register("kv", tb, lb)
        b.publish(store)
        peer = a.connect_by_name(store, "decode-r", timeout=5)
        a.write(peer, [0, 5], [3, 1]).wait()
        assert_blocks_equal(la, ta, [0, 5], lb, tb, [3, 1])
        assert_untouched(lb, tb, [3, 1])
        with pytest.raises(StoreTimeoutError):
            a.connect_by_name(store, "nobody", timeout=0.2)


def _frozen_host(backend, tmp_path):
    """A store server in another process: (pid, URL, stop). tcp: a Python process hosting a TCPStore."""
    if backend == "etcd":
        proc, url = start_etcd(tmp_path)
        return proc.pid, url, lambda: stop(proc)
    code = ("import time; from xfer.store import open_store\n"
            "s = open_store('tcp://127.0.0.1:0'); print(s.port, flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc.pid, f"tcp://127.0.0.1:{port}", lambda: stop(proc)


@pytest.mark.parametrize("backend", ["tcp", "etcd"])
def test_frozen_server_every_call_returns_by_its_bound(backend, tmp_path):
    """SIGSTOP the server: every call returns by its bound (torch's client alone blocks for good),
    a pile-up of unanswered calls fails fast, and after SIGCONT the same store object works again."""
    import os
    import signal

    pid, url, kill = _frozen_host(backend, tmp_path)
    peer = open_store(url, timeout=1.0, prefix=f"frozen-{uuid.uuid4().hex}/")
    try:
        peer.set("k", b"v")
        freeze(pid)  # returns once every thread is stopped: a loaded host could still answer otherwise
        try:
            calls = [("try_get", lambda: peer.try_get("k"), 1.0), ("get", lambda: peer.get("absent", 0.5), 1.5),
                     ("set", lambda: peer.set("k2", b"x"), 1.0), ("add", lambda: peer.add("n", 1), 1.0)]
            for name, call, bound in calls:
                t0 = time.monotonic()
                with pytest.raises(StoreError) as ei:
                    call()
                elapsed = time.monotonic() - t0
                assert elapsed < bound + SLACK, (name, elapsed)
                assert peer.endpoint in str(ei.value), name
            if backend == "tcp":  # torch's client never gives up: four calls are still stuck
                t0 = time.monotonic()
                with pytest.raises(StoreTimeoutError, match="still unanswered"):
                    peer.delete("k")
                assert time.monotonic() - t0 < 0.2
            t0 = time.monotonic()
            with pytest.raises(StoreError):  # a new connection to the frozen server is bounded too
                open_store(url, timeout=1.0)
            assert time.monotonic() - t0 < 2.0 + SLACK
        finally:
            os.kill(pid, signal.SIGCONT)
        end = time.monotonic() + 10
        while True:  # the stuck calls drain once the server runs again; then calls succeed
            try:
                assert peer.try_get("k") == b"v"
                break
            except StoreError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)
        peer.set("after", b"ok")
        assert peer.get("after", 1) == b"ok"
    finally:
        kill()
        end = time.monotonic() + 10
        while peer._unanswered and time.monotonic() < end:  # let abandoned calls see the server go
            time.sleep(0.05)
        peer.close()
