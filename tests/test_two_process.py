"""Two processes on one host through the local transport (shared host memory): the seed layout
moved with verified bytes, and real faults (a frozen peer, a killed peer) ending in typed errors
by the deadline with nothing reported complete."""

import time

import pytest

from helpers import PeerProcess, assert_blocks_equal, assert_untouched, fill_random
from xfer import Agent, AgentConfig, LayoutKind, TransferState, make_kv_cache, shared_empty
from xfer.errors import PeerDisconnectedError, TransferTimeoutError

# the seed case: 64 layers x K/V x 128 of 256 blocks (small slices on CPU: 4 tokens x 1 head x 16 bf16 = 128 B)
SEED = dict(num_layers=64, num_blocks=256, block_size=4, num_heads=1, head_dim=16)
KIND = LayoutKind.VLLM_FLASH_ATTN_NHD


@pytest.fixture
def decode():
    peer = PeerProcess("decode", KIND, SEED)
    yield peer
    peer.close()


@pytest.fixture
def prefill():
    tensors, layout = make_kv_cache(KIND, **SEED)
    fill_random(tensors, seed=7)
    agent = Agent("prefill", AgentConfig(default_timeout_s=20))
    agent.register("kv", tensors, layout)
    yield agent, tensors, layout
    agent.close()


def test_seed_write_across_processes(prefill, decode):
    agent, tensors, layout = prefill
    peer = agent.connect(decode.metadata)
    assert agent.route(peer).kind.value == "local"
    src = list(range(0, 256, 2))  # 128 blocks, every other one: 16,384 separate slices
    dst = list(range(128, 256))[::-1]
    t = agent.write(peer, src, dst, notify=b"req-42")
    t.wait()
    assert t.poll() is TransferState.DONE
    assert decode.call("notification", 5) == ("ok", "prefill", "write", dst, b"req-42")
    remote = decode.tensors()
    assert_blocks_equal(layout, tensors, src, decode.tensors_layout, remote, dst)
    assert_untouched(decode.tensors_layout, remote, dst)


def test_seed_read_across_processes(prefill):
    agent, tensors, layout = prefill
    for t in tensors:
        t.view(-1).view(dtype=__import__("torch").uint8).fill_(0xA5)
    peer_proc = PeerProcess("prefill-remote", KIND, SEED, seed=11)
    try:
        peer = agent.connect(peer_proc.metadata)
        src, dst = list(range(128)), list(range(64, 192))
        agent.read(peer, src, dst, notify=b"pulled").wait()
        assert peer_proc.call("notification", 5) == ("ok", "prefill", "read", src, b"pulled")
        assert_blocks_equal(peer_proc.tensors_layout, peer_proc.tensors(), src, layout, tensors, dst)
        assert_untouched(layout, tensors, dst)
    finally:
        peer_proc.close()


def test_peer_writes_back_over_its_own_connection(prefill, decode):
    agent, _, _ = prefill
    # the decode process can reach only shared memory of ours: register the region there
    tensors, layout = make_kv_cache(KIND, empty=shared_empty, **SEED)
    agent.deregister("kv")
    agent.register("kv", tensors, layout)
    agent.connect(decode.metadata)
    assert decode.call("connect", agent.metadata()) == "prefill"
    # decode pushes its (poisoned) blocks 0..3 into prefill's blocks 10..13
    assert decode.call("write", ("prefill", [0, 1, 2, 3], [10, 11, 12, 13], 10)) == ("ok",)
    assert_blocks_equal(decode.tensors_layout, decode.tensors(), [0, 1, 2, 3], layout, tensors, [10, 11, 12, 13])
    note = agent.wait_notification(5)
    assert note.peer == "decode" and note.blocks.tolist() == [10, 11, 12, 13]


def test_private_memory_cannot_be_reached_one_sided(prefill):
    agent, _, _ = prefill  # its region is plain (private) host memory
    pinned = PeerProcess("decode-local", KIND, SEED, config=AgentConfig(transport="local"))
    try:
        agent.connect(pinned.metadata)
        pinned.call("connect", agent.metadata())
        status, err, msg = pinned.call("write", ("prefill", [0], [0], 5))
        assert (status, err) == ("error", "TransportUnavailableError")
        assert "pinned transport 'local'" in msg and "not in shared memory" in msg
    finally:
        pinned.close()


def test_frozen_peer_times_out_by_the_deadline(prefill, decode):
    agent, _, _ = prefill
    peer = agent.connect(decode.metadata)
    decode.stop_signal()  # SIGSTOP: alive, holds its sockets, answers nothing
    start = time.monotonic()
    t = agent.write(peer, list(range(128)), list(range(128)), timeout=1.0)
    with pytest.raises(TransferTimeoutError):
        t.wait()
    assert time.monotonic() - start < 1.0 + 0.5
    assert t.poll() is TransferState.TIMED_OUT


def test_killed_peer_ends_transfer_with_disconnect_before_deadline(prefill, decode):
    agent, _, _ = prefill
    peer = agent.connect(decode.metadata)
    decode.stop_signal()
    t = agent.write(peer, list(range(128)), list(range(128)), timeout=10.0)
    time.sleep(0.3)  # the data is in the peer's pages; the transfer waits for the acknowledgement
    start = time.monotonic()
    decode.kill()
    with pytest.raises(PeerDisconnectedError):
        t.wait()
    assert time.monotonic() - start < 2.0  # noticed at once, not at the 10 s deadline
    assert t.poll() is TransferState.FAILED
    # a new transfer to the dead peer fails fast with the same typed error
    t2 = agent.write(peer, [0], [0], timeout=10.0)
    with pytest.raises(PeerDisconnectedError):
        t2.wait()


def test_peer_killed_mid_copy(decode):
    tensors, layout = make_kv_cache(KIND, **SEED)
    fill_random(tensors, seed=3)
    # one block per chunk: the copy takes many steps and checks the peer between them
    with Agent("prefill", AgentConfig(chunk_bytes=1)) as agent:
        agent.register("kv", tensors, layout)
        peer = agent.connect(decode.metadata)
        t = agent.write(peer, list(range(256)), list(range(256)), timeout=20.0)
        time.sleep(0.05)
        decode.kill()
        with pytest.raises((PeerDisconnectedError, TransferTimeoutError)):
            t.wait()
        assert t.poll() is not TransferState.DONE
