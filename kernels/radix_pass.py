"""A stable sort of the update's row keys over the batch's ids alone: one pass of a
least-significant-digit radix sort, ``RADIX_BITS`` bits of the key per pass.

``torch.sort`` sorts the whole index tensor, whose capacity is often twice the batch's
ids (a captured step cannot size it by the batch), over every bit of the key type, and
carries int64 positions. Here the ids' span is read on the device (``first`` and
``end``: the first bag's start and the last bag's end), so that the passes read and
write only the batch's ids, the key's bits are only those of the group's rows
(``passes``), and the positions the sort carries are int32 where they fit. The first
pass reads the span, and every pass writes its first ``end - first`` positions; the
last one writes the sentinel past them, so that the sorted keys read as a sort of
``update_keys``' padded ones does, sentinels last.

Each pass is two launches of one kernel over tiles of ``TILE`` positions and a
cumulative sum between them: counting (``SCATTER`` off) stores every tile's count of
each digit in ``counts``, digit-major; the sum over it gives each (digit, tile) its
first position in the pass's output; scattering (``SCATTER`` on) stores every key and
its position there, after the tile's earlier keys of the same digit (a cumulative sum
over the tile's one-hot digits), which keeps the sort stable. A key's digits are its
bits ``shift ...`` from the low end.

Buffers:
    keys:       int32 or int64 [N]  the pass's keys (the first pass: positions
                ``[first, end)``; the others: ``[0, end - first)``)
    values:     int32 or int64 [N]  the positions the keys came from (not read by the
                first pass: the position itself)
    first:      int64 [1]  the first position to sort
    end:        int64 [1]  the end of the positions to sort (at most N)
    counts:     int32 [RADIX, tiles]  out when counting: per digit and tile, its keys;
                in when scattering
    sums:       int32 [RADIX * tiles]  in when scattering: ``counts``' cumulative sum,
                digit-major
    keys_out:   int32 or int64 [N]  out when scattering: the keys in the pass's order
                (with ``LAST``, the sentinel past them)
    values_out: int32 or int64 [N]  out when scattering: their positions
"""

from typing import List, Tuple

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
#: Index tensors of fewer positions are sorted by ``torch.sort`` (``FusedUpdate.prepare``):
#: its few launches cost less host time than the passes' launches, and its device time
#: is small there.
MIN_KEYS = 1 << 21


@triton.jit(do_not_specialize=["n", "shift", "tiles"])
def radix_pass_kernel(
    keys_ptr,
    values_ptr,
    first_ptr,
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
    first = tl.minimum(tl.maximum(tl.load(first_ptr), 0), n)
    m = tl.maximum(tl.minimum(tl.load(end_ptr), n) - first, 0)
    q = t * TILE + tl.arange(0, TILE)
    inside = q < m
    p = q
    if FIRST:
        p += first
    key = tl.load(keys_ptr + p, mask=inside, other=0)
    digit = ((key >> shift) & (RADIX - 1)).to(tl.int32)
    radix = tl.arange(0, RADIX)
    one_hot = ((digit[:, None] == radix[None, :]) & inside[:, None]).to(tl.int32)
    if not SCATTER:
        tl.store(counts_ptr + radix.to(tl.int64) * tiles + t, tl.sum(one_hot, axis=0))
    else:
        if t * TILE < m:
            # Earlier keys of the same digit in the tile, then in earlier tiles and digits.
            earlier = tl.sum((tl.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)
            at = digit.to(tl.int64) * tiles + t
            start = tl.load(sums_ptr + at, mask=inside, other=0) - tl.load(counts_ptr + at, mask=inside, other=0)
            dest = (start + earlier).to(tl.int64)
            if FIRST:
                value = p.to(values_out_ptr.dtype.element_ty)
            else:
                value = tl.load(values_ptr + p, mask=inside, other=0)
            tl.store(keys_out_ptr + dest, key, mask=inside)
            tl.store(values_out_ptr + dest, value, mask=inside)
        if LAST:
            past = (q >= m) & (q < n)
            tl.store(keys_out_ptr + q, tl.full([TILE], SENTINEL, keys_out_ptr.dtype.element_ty), mask=past)


_launcher = Launcher(radix_pass_kernel)


def passes(key_bits: int) -> List[int]:
    """The shifts of the passes that sort keys of ``key_bits`` bits."""
    return list(range(0, max(key_bits, 1), RADIX_BITS))


def radix_sort(
    keys: torch.Tensor, first: torch.Tensor, end: torch.Tensor, key_bits: int, sentinel: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sorts ``keys[first:end]`` stably by their low ``key_bits`` bits; returns the
    sorted keys (then the sentinel) and the positions they came from (int32 where N
    fits; undefined past ``end - first``). ``keys`` is overwritten; every launch is
    enqueued on the current stream."""
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
                first,
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
