"""Python model of the FlyDSL kernels' LDS ping-pong schedule, and a race checker for it.

The kernels (``grouped_gemm_fp8.py``) share two LDS buffers (A and B tiles of one K block each)
between the 4 waves of a workgroup: while the MFMAs of block k read one buffer, block k+1 is
written into the other. Waves run freely between ``s_barrier``s, so an LDS write is safe only if
every wave has finished its reads of that buffer *and passed a barrier since*, and a read is safe
only if the write it needs has completed (``vmcnt`` for LDS-DMA, ``lgkmcnt`` for ``ds_write``)
before a barrier that precedes the read.

This module writes the schedule down as a list of events per persistent tile, concatenated over
the tiles a workgroup computes (the LDS is reused from one tile to the next, which is where the
issue-14 race was: an odd number of K blocks ended with a read of buffer 0 that no barrier
followed, and the next tile's prologue DMA'd into buffer 0 at once). :func:`lds_races` then says
which accesses may overlap in time on some wave interleaving.

Timing model (what ``s_barrier`` and ``s_waitcnt`` guarantee). Barriers cut a wave's program into
phases; a wave in phase p+1 knows every wave has *issued* everything of phase p, and every access
whose wait it passed before the barrier has *completed*. An access issued in phase p and waited
for in phase q is in flight in phases p..q on its wave. Since all waves run the same program, two
accesses of different waves can touch LDS at the same time iff their phase ranges intersect. A
write and a read (or two writes of different waves; not modelled: the waves write disjoint rows)
of one buffer with intersecting ranges is a race.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

__all__ = [
    "Event",
    "dma_tile_events",
    "register_staged_tile_events",
    "persistent_events",
    "lds_races",
    "stale_reads",
]

# Event kinds. "dma": buffer_load ... lds into a buffer (completes at the next "wait_vm");
# "ds_write": registers -> LDS (completes at the next "wait_lgkm"); "read": the ds_reads of the
# MFMAs of one K block (completes at the next "wait_lgkm": the MFMAs consume the data, so the
# compiler always waits for it in the same phase, modelled as an explicit wait after the read);
# "wait_vm" / "wait_lgkm": s_waitcnt vmcnt(0) / lgkmcnt(0); "barrier": s_barrier.
KINDS = ("dma", "ds_write", "read", "wait_vm", "wait_lgkm", "barrier")


@dataclass(frozen=True)
class Event:
    kind: str
    buffer: int = -1
    tile: int = 0
    block: int = -1  # the K block moved or read (-1 for waits and barriers)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}")


def _fence_dma(tile):
    return [Event("wait_vm", tile=tile), Event("wait_lgkm", tile=tile), Event("barrier", tile=tile)]


def _fence(tile):
    return [Event("wait_lgkm", tile=tile), Event("barrier", tile=tile)]


def _mma(tile, buffer, block):
    return [Event("read", buffer, tile, block), Event("wait_lgkm", tile=tile)]


def dma_tile_events(k_blocks: int, tile: int = 0, tail_fence: bool = True) -> List[Event]:
    """The LDS events of one tile of the LDS-DMA M-grouped kernel, in program order (a copy of
    ``build_m_grouped``'s ``lds_dma`` branch). ``tail_fence=False`` is the schedule before issue 14:
    no barrier after the odd last block's reads."""
    ev = [Event("dma", 0, tile, 0)]
    ev += _fence_dma(tile)
    for kp in range(k_blocks // 2):
        ev.append(Event("dma", 1, tile, 2 * kp + 1))
        ev += _mma(tile, 0, 2 * kp)
        ev += _fence_dma(tile)
        ev.append(Event("dma", 0, tile, 2 * kp + 2))
        ev += _mma(tile, 1, 2 * kp + 1)
        ev += _fence_dma(tile)
    if k_blocks % 2 == 1:
        ev += _mma(tile, 0, k_blocks - 1)
        if tail_fence:
            ev += _fence(tile)
    return ev


def register_staged_tile_events(k_blocks: int, tile: int = 0) -> List[Event]:
    """The LDS events of one tile of the register-staged loop (``_register_prologue`` and
    ``_register_step``: register prefetches touch no LDS until their step's ds_write)."""
    ev = [Event("ds_write", 0, tile, 0)]
    ev += _fence(tile)
    for kb in range(k_blocks):
        ev += _mma(tile, kb % 2, kb)
        ev.append(Event("ds_write", (kb + 1) % 2, tile, kb + 1))
        ev += _fence(tile)
    return ev


def persistent_events(tile_k_blocks: Sequence[int], tile_events=dma_tile_events, **kwargs) -> List[Event]:
    """The events of one workgroup computing tiles with these K-block counts, one after the other
    (the persistent loop: nothing between two tiles' LDS events but the epilogue's global stores)."""
    out: List[Event] = []
    for tile, k_blocks in enumerate(tile_k_blocks):
        out += tile_events(k_blocks, tile=tile, **kwargs)
    return out


def _access_ranges(events: Sequence[Event]) -> List[Tuple[Event, int, int]]:
    """(access, first phase, last phase) of every dma / ds_write / read."""
    phase = 0
    open_vm: List[Tuple[Event, int]] = []
    open_lgkm: List[Tuple[Event, int]] = []
    ranges: List[Tuple[Event, int, int]] = []
    for ev in events:
        if ev.kind == "barrier":
            phase += 1
        elif ev.kind == "wait_vm":
            ranges += [(e, p, phase) for e, p in open_vm]
            open_vm = []
        elif ev.kind == "wait_lgkm":
            ranges += [(e, p, phase) for e, p in open_lgkm]
            open_lgkm = []
        elif ev.kind == "dma":
            open_vm.append((ev, phase))
        else:
            open_lgkm.append((ev, phase))
    # Never waited for: in flight until the end of the program.
    ranges += [(e, p, phase) for e, p in open_vm + open_lgkm]
    return ranges


def lds_races(events: Sequence[Event]) -> List[Tuple[Event, Event]]:
    """Pairs (write, read) of one buffer that may overlap in time on some wave interleaving:
    a write that can reach the buffer before every wave's last read of it is done (WAR), or a
    read that can see the buffer before the write it follows has landed everywhere (RAW)."""
    ranges = _access_ranges(events)
    writes = [(e, lo, hi) for e, lo, hi in ranges if e.kind in ("dma", "ds_write")]
    reads = [(e, lo, hi) for e, lo, hi in ranges if e.kind == "read"]
    races = []
    for w, wlo, whi in writes:
        for r, rlo, rhi in reads:
            if w.buffer == r.buffer and wlo <= rhi and rlo <= whi:
                races.append((w, r))
    return races


def stale_reads(events: Sequence[Event]) -> List[Event]:
    """Reads whose buffer, in program order, was last written with another K block than the one
    the read is for (the ping-pong indexing is wrong), or never written in this tile."""
    last = {}
    bad = []
    for ev in events:
        if ev.kind in ("dma", "ds_write"):
            last[ev.buffer] = (ev.tile, ev.block)
        elif ev.kind == "read" and last.get(ev.buffer) != (ev.tile, ev.block):
            bad.append(ev)
    return bad
