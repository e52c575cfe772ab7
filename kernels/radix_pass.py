"""A stable sort of the update's row keys over the batch's ids alone: one pass of a
least-significant-digit radix sort, ``RADIX_BITS`` bits of the key per pass.

``torch.sort`` sorts the whole index tensor, whose capacity is often twice the batch's
ids (a captured step cannot size it by the batch), over every bit of the key type, and
carries int64 positions. Here the number of keys to sort is read on the device
(``end``: the last bag's end), so that the passes read and write only the batch's
ids, the key's bits are only those of the group's rows (``passes``), and the positions
the sort carries are int32 where they fit. A position past the ids keeps its key (the
sentinel) and the last pass writes the sentinel over every position past ``end`` of
its output, so that the sorted keys read as ``update_keys``' do, sentinels last.

Each pass is two launches of one kernel over tiles of ``TILE`` positions and a
cumulative sum between them: counting (``SCATTER`` off) stores every tile's count of
each digit in ``counts``, digit-major; the sum over it gives each (digit, tile) its
first position in the pass's output; scattering (``SCATTER`` on) stores every key and
its position there, after the tile's earlier keys of the same digit (a cumulative sum
over the tile's one-hot digits), which keeps the sort stable. A key's digits are its
bits ``shift ...`` from the low end; the sentinel's are all ones, so it sorts after
every row key of fewer bits.

Buffers:
    keys:       int32 or int64 [N]  the pass's keys (positions ``[0, end)``)
    values:     int32 or int64 [N]  the positions the keys came from (not read with
                ``FIRST``: the position itself)
    end:        int64 [1]  the number of keys to sort (at most N)
    counts:     int32 [RADIX, tiles]  out when counting: per digit and tile, its keys;
                in when scattering
    sums:       int32 [RADIX * tiles]  in when scattering: ``counts``' cumulative sum,
                digit-major
    keys_out:   int32 or int64 [N]  out when scattering: the keys in the pass's order
                (with ``LAST``, the sentinel past ``end``)
    values_out: int32 or int64 [N]  out when scattering: their positions
"""

from typing import List

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv

#: Key bits sorted per pass (``RADIX`` digits).
RADIX_BITS = 4
RADIX = 1 << RADIX_BITS
#: Positions per program.
TILE = 1024
NUM_WARPS = 8
#: Index tensors of fewer positions are sorted by ``torch.sort``: its few launches cost
#: less host time than the passes' launches, and its device time is small there.
MIN_KEYS = 1 << 21


@triton.jit(do_not_specialize=["n", "shift", "tiles"])
def radix_pass_kernel(
    keys_ptr,
    values_ptr,
    end_ptr,
    counts_ptr,
    sums_ptr,
    keys_out_ptr,
    values_out_ptr,
    n: tl.int64,
    shift: tl.int64,
    tiles: tl.int64,
    FIRST: tl.constexpr,
    SCATTER: tl.constexpr,
    LAST: tl.constexpr,
    SENTINEL: tl.constexpr,
    RADIX: tl.constexpr,
    TILE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    end = tl.minimum(tl.load(end_ptr), n)
    p = t * TILE + tl.arange(0, TILE)
    inside = p < end
    key = tl.load(keys_ptr + p, mask=inside, other=0)
    digit = ((key >> shift) & (RADIX - 1)).to(tl.int32)
    radix = tl.arange(0, RADIX)
    one_hot = ((digit[:, None] == radix[None, :]) & inside[:, None]).to(tl.int32)
    if not SCATTER:
        tl.store(counts_ptr + radix.to(tl.int64) * tiles + t, tl.sum(one_hot, axis=0))
    else:
        if t * TILE < end:
            # Earlier keys of the same digit in the tile, then in earlier tiles and digits.
            earlier = tl.sum((tl.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)
            at = digit.to(tl.int64) * tiles + t
            first = tl.load(sums_ptr + at, mask=inside, other=0) - tl.load(counts_ptr + at, mask=inside, other=0)
            dest = (first + earlier).to(tl.int64)
            if FIRST:
                value = p.to(values_out_ptr.dtype.element_ty)
            else:
                value = tl.load(values_ptr + p, mask=inside, other=0)
            tl.store(keys_out_ptr + dest, key, mask=inside)
            tl.store(values_out_ptr + dest, value, mask=inside)
        if LAST:
            past = (p >= end) & (p < n)
            tl.store(keys_out_ptr + p, tl.full([TILE], SENTINEL, keys_out_ptr.dtype.element_ty), mask=past)


_launcher = Launcher(radix_pass_kernel)


def passes(key_bits: int) -> List[int]:
    """The shifts of the passes that sort keys of ``key_bits`` bits."""
    return list(range(0, max(key_bits, 1), RADIX_BITS))


def radix_sort(keys: torch.Tensor, end: torch.Tensor, key_bits: int, sentinel: int) -> tuple:
    """Sorts ``keys[:end]`` stably by their low ``key_bits`` bits (the sentinel's, all
    ones, after every other key's); returns the sorted keys (the sentinel past ``end``)
    and the positions they came from (int32 where N fits; undefined past ``end``).
    ``keys`` is overwritten; every launch is enqueued on the current stream."""
    n = keys.numel()
    index = torch.int32 if n < 2**31 else torch.int64
    tiles = max(cdiv(n, TILE), 1)
    counts = torch.empty(RADIX, tiles, dtype=torch.int32, device=keys.device)
    sums = torch.empty(RADIX * tiles, dtype=torch.int32, device=keys.device)
    buffers = [(keys, torch.empty(n, dtype=index, device=keys.device))]
    buffers.append((torch.empty_like(keys), torch.empty(n, dtype=index, device=keys.device)))
    shifts = passes(key_bits)
    for i, shift in enumerate(shifts):
        (k_in, v_in), (k_out, v_out) = buffers[i % 2], buffers[(i + 1) % 2]
        for scatter in (False, True):
            if scatter:
                torch.cumsum(counts.view(-1), 0, dtype=torch.int32, out=sums)
            _launcher[(tiles,)](
                k_in,
                v_in,
                end,
                counts,
                sums,
                k_out,
                v_out,
                n,
                shift,
                tiles,
                FIRST=i == 0,
                SCATTER=scatter,
                LAST=scatter and i == len(shifts) - 1,
                SENTINEL=sentinel,
                RADIX=RADIX,
                TILE=TILE,
                num_warps=NUM_WARPS,
            )
    return buffers[len(shifts) % 2]


def stable_sort(keys: torch.Tensor, end: torch.Tensor, key_bits: int, sentinel: int) -> tuple:
    """``radix_sort``, or a stable ``torch.sort`` of all of ``keys`` where they are
    fewer than ``MIN_KEYS`` (the same order up to ``end``; int64 positions)."""
    if keys.numel() < MIN_KEYS:
        return torch.sort(keys, stable=True)
    return radix_sort(keys, end, key_bits, sentinel)
