"""CPU tests of the LDS ping-pong schedule of the FlyDSL kernels across consecutive persistent
tiles (kernels/flydsl/lds_schedule.py): no LDS write may reach a buffer before every wave's last
read of it, no read may see a buffer before its write landed, and every read sees its own K block.

The schedule before issue 14 (no barrier after the odd last K block of the LDS-DMA kernel) stays
reachable as ``tail_fence=False``: the strict xfail below is the race test failing on it."""

from __future__ import annotations

import itertools

import pytest

from turbo_moe.kernels.flydsl import lds_schedule as ls

# Every sequence of 1..3 tiles with 0..5 K blocks each (odd and even, one block, empty groups).
TILE_SEQUENCES = [seq for n in (1, 2, 3) for seq in itertools.product(range(6), repeat=n)]


def _dma_races(tail_fence):
    found = []
    for seq in TILE_SEQUENCES:
        # The LDS-DMA kernel is M-grouped: K >= 1, so every tile has at least one K block.
        if 0 in seq:
            continue
        events = ls.persistent_events(seq, ls.dma_tile_events, tail_fence=tail_fence)
        found += [(seq, race) for race in ls.lds_races(events)]
        assert not ls.stale_reads(events), seq
    return found


@pytest.mark.parametrize(
    "tail_fence",
    [True, pytest.param(False, marks=pytest.mark.xfail(strict=True, reason="issue 14: the schedule before the fix"))],
)
def test_lds_dma_schedule_has_no_race_across_persistent_tiles(tail_fence):
    races = _dma_races(tail_fence)
    assert not races, races[:3]


def test_old_lds_dma_schedule_races_exactly_after_an_odd_tile():
    # The race the fix closes: tile t ends with an odd K-block count, its last read of buffer 0
    # has no barrier after it, and tile t+1's prologue DMA writes buffer 0.
    for seq in [(1, 1), (3, 2), (5, 4), (2, 3, 1)]:
        events = ls.persistent_events(seq, ls.dma_tile_events, tail_fence=False)
        races = ls.lds_races(events)
        expected = [t for t in range(len(seq) - 1) if seq[t] % 2 == 1]
        assert sorted({(w.tile, r.tile) for w, r in races}) == [(t + 1, t) for t in expected], (seq, races)
        for write, read in races:
            assert write.kind == "dma" and write.buffer == read.buffer == 0
            assert write.block == 0 and read.block == seq[read.tile] - 1
    # Even counts alone never raced: the loop's last fence follows the last read.
    assert not ls.lds_races(ls.persistent_events((2, 4, 2), ls.dma_tile_events, tail_fence=False))


def test_register_staged_schedule_has_no_race_with_empty_groups():
    # K-grouped tiles of an empty group run zero K blocks: prologue write, fence, nothing else.
    for seq in TILE_SEQUENCES:
        events = ls.persistent_events(seq, ls.register_staged_tile_events)
        assert not ls.lds_races(events), seq
        assert not ls.stale_reads(events), seq


def test_race_checker_catches_a_missing_vmcnt_wait_and_a_missing_barrier():
    # The checker must be able to fail: drop the vmcnt wait before a loop barrier (Primus-Turbo
    # PR 384's corruption: DMA writes are counted by vmcnt) or one barrier, and it reports a race.
    events = ls.dma_tile_events(4)
    loop_wait = [i for i, e in enumerate(events) if e.kind == "wait_vm"][1]
    assert ls.lds_races(events[:loop_wait] + events[loop_wait + 1:])
    loop_barrier = [i for i, e in enumerate(events) if e.kind == "barrier"][1]
    assert ls.lds_races(events[:loop_barrier] + events[loop_barrier + 1:])
    reg = ls.register_staged_tile_events(3)
    barrier = [i for i, e in enumerate(reg) if e.kind == "barrier"][2]
    assert ls.lds_races(reg[:barrier] + reg[barrier + 1:])


def test_stale_read_checker_catches_a_wrong_buffer_index():
    events = ls.dma_tile_events(3)
    bad = [ls.Event("read", 1 - e.buffer, e.tile, e.block) if e.kind == "read" and e.block == 1 else e for e in events]
    assert ls.stale_reads(bad)
