"""Agent metadata: round trip, and a typed MetadataError for anything truncated or malformed."""

import json
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xfer import Agent, LayoutKind, make_kv_cache
from xfer import metadata as md
from xfer.errors import MetadataError


@pytest.fixture(scope="module")
def blob():
    tensors, layout = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_HND, num_layers=2, num_blocks=4, block_size=2,
                                    num_heads=2, head_dim=4)
    with Agent("meta") as agent:
        agent.register("kv", tensors, layout)
        yield agent.metadata()


def wrap(payload: bytes, *, magic=md.MAGIC, version=md.VERSION, length=None, crc=None) -> bytes:
    return struct.pack("!4sHII", magic, version, len(payload) if length is None else length,
                       zlib.crc32(payload) if crc is None else crc) + payload


def test_round_trip(blob):
    parsed = md.decode(blob)
    assert parsed.name == "meta" and set(parsed.regions) == {"kv"}
    assert parsed.regions["kv"].layout.inner_order == "HNC"
    assert md.encode(parsed) == blob


def test_every_truncation_is_rejected(blob):
    for cut in range(len(blob)):
        with pytest.raises(MetadataError):
            md.decode(blob[:cut])


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(min_value=0), bit=st.integers(0, 7))
def test_bit_flips_are_rejected(blob, pos, bit):
    pos %= len(blob)
    damaged = bytearray(blob)
    damaged[pos] ^= 1 << bit
    with pytest.raises(MetadataError):
        md.decode(bytes(damaged))


@pytest.mark.parametrize("blob_, pattern", [
    (b"NOPE" + bytes(10), "not xfer metadata"),
    (struct.pack("!4sHII", md.MAGIC, 99, 0, 0), "version 99"),
    (wrap(b"{}", crc=1), "checksum"),
    (wrap(b"\xff\xfe"), "not JSON"),
    (wrap(b"[1, 2]"), "must be an object"),
    (wrap(b"{}"), "lacks field 'control'"),
    (wrap(json.dumps({"control": ["127.0.0.1", 70000]}).encode()), r"control must be \[host, port\]"),
    (wrap(b"x" * 10, length=11), "truncated or padded"),
    ("not bytes", "must be bytes"),
])
def test_malformed_metadata_names_the_problem(blob_, pattern):
    with pytest.raises(MetadataError, match=pattern):
        md.decode(blob_)


def test_bad_field_types_and_layouts(blob):
    good = json.loads(blob[struct.calcsize("!4sHII"):])
    for mutate, pattern in [
        (lambda d: d.update(pid="12"), "agent.pid must be int"),
        (lambda d: d["regions"]["kv"].pop("device"), "lacks field 'device'"),
        (lambda d: d["regions"]["kv"]["layout"].update(dtype="complex_nonsense"), "unknown dtype"),
        (lambda d: d["regions"]["kv"]["layout"].update(num_blocks=-1), "num_blocks must be a positive int"),
        (lambda d: d["regions"]["kv"]["layout"].update(slot_offset=[0]), "slot tables"),
        (lambda d: d["regions"]["kv"]["layout"].update(tensor_numel=[1, 1]), "spans elements"),
        (lambda d: d["transports"].update(local=5), "info must be an object"),
        (lambda d: d.update(control_unix="/tmp/xfer.sock"), "control_unix must be an xfer control socket"),
        (lambda d: d.update(control_unix="xfer-ctl-" + "0" * 23), "control_unix must be an xfer control socket"),
        (lambda d: d.update(control_unix="xfer-ctl-" + "A" * 24), "control_unix must be an xfer control socket"),
        (lambda d: d.update(control_unix=["xfer-ctl-" + "0" * 24]), "control_unix must be an xfer control socket"),
    ]:
        d = json.loads(json.dumps(good))
        mutate(d)
        with pytest.raises(MetadataError, match=pattern):
            md.decode(wrap(json.dumps(d).encode()))


def test_agent_rejects_malformed_metadata_before_connecting():
    with Agent("a") as agent:
        with pytest.raises(MetadataError):
            agent.connect(b"garbage")
        assert agent.peers == []


def test_layout_round_trips_every_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.uint8):
        _, layout = make_kv_cache(LayoutKind.VLLM_FLASHINFER, num_layers=1, num_blocks=2, block_size=2,
                                  num_heads=1, head_dim=2, dtype=dtype, device="meta")
        assert md.KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
