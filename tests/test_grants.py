"""The target's table of holds (xfer.transports.grants): who may hold which blocks at once.

A hold clashes only with another owner's unfenced hold on the same blocks where either side
writes; one owner's overlapping holds are its own order to keep. The table keeps each region's
live holds by owner (a new hold looks for a clash among the other owners' holds only): these
tests pin the rule and that the by-owner index follows every end (nothing left behind)."""

from __future__ import annotations

import numpy as np
import pytest

from xfer.errors import BlocksBusyError
from xfer.layout import LayoutKind, make_kv_cache
from xfer.transports.base import LocalRegion
from xfer.transports.grants import Grants


@pytest.fixture
def table():
    ts, layout = make_kv_cache(LayoutKind.VLLM_FLASH_ATTN_NHD, num_layers=2, num_blocks=32, block_size=4,
                               num_heads=1, head_dim=8)
    return Grants("host"), LocalRegion(name="kv", tensors=ts, layout=layout)


def hold(g, region, ids, owner, writes=True):
    return g.hold(region, np.asarray(ids, dtype=np.int64), writes=writes, peer=str(owner), tid="t", owner=owner)


def test_one_owners_overlapping_holds_pass_another_owners_clash_is_named(table):
    g, region = table
    mine = [hold(g, region, [0, 1, 2, 3], "A") for _ in range(100)]  # a burst over one block set
    with pytest.raises(BlocksBusyError, match=r"Hold\(\d+: transfer t from 'A' writes 4 blocks"):
        hold(g, region, [3, 9], "B")
    other = hold(g, region, [9, 10], "B")  # blocks A does not hold
    for h in mine[:-1]:
        g.end(h)
    with pytest.raises(BlocksBusyError):  # one of A's is still live
        hold(g, region, [2], "B")
    g.end(mine[-1])
    again = hold(g, region, [2], "B")
    owners = g._busy(region).owners
    assert set(owners) == {"B"} and set(owners["B"]) == {other.id, again.id}
    g.end(other)
    g.end(again)
    g.end(again)  # idempotent
    assert owners == {} and len(g) == 0
    assert not g._busy(region).writes.any()


def test_reads_share_writes_do_not_and_no_owner_clashes_with_everyone(table):
    g, region = table
    r1 = hold(g, region, [5], "A", writes=False)
    r2 = hold(g, region, [5], "B", writes=False)  # two readers
    with pytest.raises(BlocksBusyError):
        hold(g, region, [5], "B")  # B writes what A reads
    for h in (r1, r2):
        g.end(h)
    anon = hold(g, region, [6], None)
    with pytest.raises(BlocksBusyError):
        hold(g, region, [6], None)  # an ownerless hold clashes even with another ownerless one
    with pytest.raises(BlocksBusyError):
        hold(g, region, [6], "A")
    g.end(anon)
    assert g._busy(region).owners == {} and len(g) == 0
