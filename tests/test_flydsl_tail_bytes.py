"""CPU test of the register path's exact tail loads (issue 14, item 3): with a contraction length
% 4 != 0 the operand's last valid bytes sit in a dword that straddles num_records at the tensor's
end. Needs torch only."""

from __future__ import annotations

import pytest
import torch

from turbo_moe.kernels.flydsl import host

BK = host.BLOCK_K

# ----------------------------------------------------------------------------------------------
# Contraction length % 4 != 0 on the register path: a dword straddling num_records.
# ----------------------------------------------------------------------------------------------


def _dword_load(mem, nrec, offset, strict):
    """One dword of a buffer load. The ISA range-checks multi-dword buffer loads per dword; a dword
    with some bytes past num_records reads as 0 (``strict``, the reading that breaks) or reads
    its in-range bytes (the lenient one). Which one gfx950 does is not verified on hardware."""
    out = torch.zeros(4, dtype=torch.uint8)
    if strict and offset + 4 > nrec:
        return out
    count = max(0, min(nrec - offset, 4))
    out[:count] = mem[offset: offset + count]
    return out


def _byte_load(mem, nrec, offset):
    return mem[offset].clone() if offset < nrec else torch.tensor(0, dtype=torch.uint8)


def _old_chunk(mem, nrec, offset, valid, strict):
    data = torch.cat([_dword_load(mem, nrec, offset + 4 * w, strict) for w in range(4)])
    for w in range(4):  # the old loader: one 16-byte load, then byte masks
        kept = host.dword_valid_bytes(valid, w)
        data[4 * w + kept: 4 * w + 4] = 0
    return data


def _word(data):
    return int.from_bytes(bytes(data.tolist()), "little")


def _exact_chunk(mem, nrec, offset, valid, strict):
    """The kernel's exact loader (``_OperandLoader.load_exact``), from the same host functions."""
    raw = [_word(_dword_load(mem, nrec, offset + 4 * w, strict)) for w in range(4)]
    whole, partial = host.exact_chunk_split(valid)
    tail = 0
    for b in range(3):
        at = host.exact_byte_offset(offset, whole, partial, b, host.OOB_OFFSET)
        tail |= int(_byte_load(mem, nrec, at)) << (8 * b)
    words = [host.exact_dword(raw[w], tail, w, whole) & 0xFFFFFFFF for w in range(4)]
    return torch.tensor(list(b"".join(w.to_bytes(4, "little") for w in words)), dtype=torch.uint8)


def test_lane_arithmetic_masks_match_their_definitions():
    for a in range(-5, 20):
        for b in range(-5, 20):
            assert host.lt_mask(a, b) == (-1 if a < b else 0)
    for whole in range(5):
        for w in range(4):
            got = host.exact_dword(0x11223344, 0x00AABBCC, w, whole)
            assert got == (0x11223344 if w < whole else 0x00AABBCC if w == whole else 0)
        for partial in range(4):
            for b in range(3):
                got = host.exact_byte_offset(100, whole, partial, b, host.OOB_OFFSET)
                assert got == (100 + 4 * whole + b if b < partial else host.OOB_OFFSET)


@pytest.mark.parametrize("k_len", [1, 2, 3, 5, 13, 14, 15, 16, 17, 130, 131, 255])
@pytest.mark.parametrize("strict", [False, True])
def test_exact_tail_load_keeps_every_valid_byte_at_the_end_of_the_tensor(k_len, strict):
    # The operand's last row ends at the tensor's last byte (num_records = bytes left); the tail
    # chunk holds the last valid bytes. The exact loader reproduces them under either range-check
    # reading; the old one (16-byte load + byte masks) loses up to 3 bytes under the strict one
    # when k_len % 4 != 0.
    torch.manual_seed(k_len)
    mem = torch.randint(1, 256, (k_len,), dtype=torch.uint8)  # no zero byte: a lost byte shows
    k0 = (k_len - 1) // BK * BK
    got_exact, got_old = [], []
    for chunk in range(host.CHUNKS_PER_ROW):
        valid = host.chunk_valid_bytes(k_len, k0, chunk)
        offset = host.masked_offset(k0 + chunk * 16, valid > 0)
        got_exact.append(_exact_chunk(mem, k_len, offset, valid, strict))
        got_old.append(_old_chunk(mem, k_len, offset, valid, strict))
    expected = torch.zeros(BK, dtype=torch.uint8)
    expected[: k_len - k0] = mem[k0:]
    assert torch.equal(torch.cat(got_exact), expected)
    old_ok = torch.equal(torch.cat(got_old), expected)
    assert old_ok == (not strict or k_len % 4 == 0), (k_len, strict)
