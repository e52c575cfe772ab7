"""Finds the first bad id and the first negative length of a KeyedJaggedTensor.

Sources validate their own ids before sending them, so an owner never indexes out of
its tables. The verdict stays on the device: ``ids_header`` turns it into the slot
headers and resets it for the next batch. Slots hold int32 lengths: the kernel
narrows a KJT's wider lengths as it reads them, which spares the step a copy of its own.

A step served with no exchange (``quant/local.py``) hands FBGEMM's lookup, whose
bounds check is off, copies the kernel writes as it reads (``SANITIZE``): the ids with
each bad one as 0, and the offsets kept between their feature's start and the next
feature's (starts in order, within the ids), so that every bag reads only ids checked
against its own table, whatever the batch (a bad batch's output is then discarded);
the same as given for a valid batch, narrowed to int32 where they fit, as TorchRec's
forward hands them.

Buffers:
    values:    int64 [n_ids]         the KJT's ids, feature-major
    offsets:   int  [F * batch + 1]  the KJT's offsets; feature f's ids start at
                                     ``offsets[f * batch]``
    lengths:   int  [F * batch]      the KJT's lengths
    narrowed:  int32 [F * batch]     out (with ``NARROW``): the lengths as int32
    num_rows:  int64 [F]             rows of each feature's table
    verdict:   int64 [2]             in/out: smallest position of an out-of-range id,
                                     smallest position of a negative length (``NONE``
                                     where there is none)
    ids_out:      int32 or int64 [n_ids]         out (with ``SANITIZE``): the ids, bad ones 0
    offsets_out:  ids_out's dtype [F * batch + 1] out (with ``SANITIZE``): the offsets,
                                                 each feature's within its ids
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv, next_power_of_2

#: What a verdict word holds when nothing is wrong.
NONE = 2**62
BLOCK = 1024
NUM_WARPS = 4
#: Features' starts read at once, at most (more are read in chunks of this many); a
#: power of two, as every block of a Triton program.
MAX_FEATURES = 1024


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _clamped(first, n_ids):
    """A first offset clamped to the ids."""
    return tl.minimum(tl.maximum(first.to(tl.int64), 0), n_ids)


@triton.jit
def _start(offsets_ptr, f, batch, n_ids):
    """Feature ``f``'s first offset, clamped to the ids."""
    return _clamped(tl.load(offsets_ptr + f * batch), n_ids)


@triton.jit(do_not_specialize=["n_ids", "n_lengths", "batch", "num_features"])
def ids_check_kernel(
    values_ptr,
    offsets_ptr,
    lengths_ptr,
    narrowed_ptr,
    num_rows_ptr,
    verdict_ptr,
    ids_out_ptr,
    offsets_out_ptr,
    n_ids: tl.int64,
    n_lengths: tl.int64,
    batch: tl.int64,
    num_features: tl.int64,
    NONE: tl.constexpr,
    NARROW: tl.constexpr,
    SANITIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    FEATURES: tl.constexpr,
):
    k0 = tl.program_id(0).to(tl.int64) * BLOCK
    k = k0 + tl.arange(0, BLOCK)
    in_ids = k < n_ids
    ids = tl.load(values_ptr + k, mask=in_ids, other=0)
    # An id belongs to the last feature that starts at or before it (features with
    # no ids start where the next one does). A feature starts at the largest of its
    # and the earlier features' first offsets, clamped to the ids: its first offset
    # for valid lengths, and in order whatever the lengths, so that the ids a
    # feature's bags can read once sanitized are those checked against its table.
    # The features' starts are read ``FEATURES`` at a time (one load's latency, not one
    # per feature) for what this program needs of them: how many start at or before
    # its first and last id, the start of the feature of its first id and of its first
    # offset; then only the features inside its own range are walked.
    bt = tl.maximum(batch, 1)
    k_last = tl.minimum(k0 + BLOCK, n_ids) - 1
    g_first = k0 // bt  # the feature of this program's first offset
    i = tl.arange(0, FEATURES)
    carry = n_ids * 0  # the running maximum of the starts before the chunk
    below_first = carry.to(tl.int32)
    below_last = below_first
    start_first = carry  # of the last feature that starts at or before k0
    start_g = carry  # of feature g_first
    for c in range(0, num_features, FEATURES):
        f = c + i
        valid = f < num_features
        first = tl.load(offsets_ptr + f * batch, mask=valid, other=0)
        starts = tl.maximum(tl.associative_scan(_clamped(first, n_ids), 0, _larger), carry)
        below_first += tl.sum((valid & (starts <= k0)).to(tl.int32))
        below_last += tl.sum((valid & (starts <= k_last)).to(tl.int32))
        start_first = tl.maximum(start_first, tl.max(tl.where(valid & (starts <= k0), starts, 0)))
        start_g = tl.maximum(start_g, tl.max(tl.where(valid & (f <= g_first), starts, 0)))
        carry = tl.maximum(carry, tl.max(tl.where(valid, starts, 0)))
    f_first = below_first - 1
    limit = tl.zeros([BLOCK], dtype=tl.int64) + tl.load(num_rows_ptr + f_first, mask=f_first >= 0, other=0)
    start = start_first
    for g in range(f_first + 1, below_last):
        start = tl.maximum(start, _start(offsets_ptr, g, batch, n_ids))
        limit = tl.where(k >= start, tl.load(num_rows_ptr + g), limit)
    bad = in_ids & ((ids < 0) | (ids >= limit))
    first_bad = tl.min(tl.where(bad, k, NONE))
    if first_bad < NONE:
        tl.atomic_min(verdict_ptr, first_bad)
    in_lengths = k < n_lengths
    lengths = tl.load(lengths_ptr + k, mask=in_lengths, other=0)
    if NARROW:
        tl.store(narrowed_ptr + k, lengths.to(tl.int32), mask=in_lengths)
    negative = in_lengths & (lengths < 0)
    first_negative = tl.min(tl.where(negative, k, NONE))
    if first_negative < NONE:
        tl.atomic_min(verdict_ptr + 1, first_negative)
    if SANITIZE:
        tl.store(ids_out_ptr + k, tl.where(bad, 0, ids).to(ids_out_ptr.dtype.element_ty), mask=in_ids)
        in_offsets = k <= n_lengths
        offsets = tl.load(offsets_ptr + k, mask=in_offsets, other=0).to(tl.int64)
        # Offset k bounds the bags of feature k // batch: between its start and the
        # next's (the ids' end after the last). A feature's first offset is its start
        # (the last offset, the ids' end). The features of this program's offsets are
        # walked: no division per offset.
        lo = tl.zeros([BLOCK], dtype=tl.int64) + n_ids
        hi = lo
        first_of_feature = k < 0
        start = tl.where(g_first < num_features, start_g, n_ids)
        for g in range(g_first, tl.minimum(k0 + BLOCK - 1, n_lengths) // bt + 1):
            has_next = g + 1 < num_features
            following = n_ids
            if has_next:
                following = tl.maximum(start, _start(offsets_ptr, g + 1, batch, n_ids))
            here = k >= g * bt
            lo = tl.where(here, start, lo)
            hi = tl.where(here, following, hi)
            first_of_feature = tl.where(here, k == g * bt, first_of_feature)
            start = following
        offsets = tl.where(first_of_feature, lo, tl.minimum(tl.maximum(offsets, lo), hi))
        offsets = tl.where(batch == 0, 0, offsets)
        tl.store(offsets_out_ptr + k, offsets.to(offsets_out_ptr.dtype.element_ty), mask=in_offsets)


_launcher = Launcher(ids_check_kernel)


def ids_check(
    values: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: torch.Tensor,
    verdict: torch.Tensor,
    batch: int,
    narrowed: Optional[torch.Tensor] = None,
    sanitized: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """Folds this batch's problems into ``verdict``; writes the lengths as int32 to
    ``narrowed`` and the ids and offsets to ``sanitized`` (``ids_out``,
    ``offsets_out``), if given (see the module docstring)."""
    n = max(values.numel(), lengths.numel() + (1 if sanitized is not None else 0))
    ids_out, offsets_out = sanitized if sanitized is not None else (values, offsets)
    if n:
        _launcher[(cdiv(n, BLOCK),)](
            values,
            offsets,
            lengths,
            lengths if narrowed is None else narrowed,
            num_rows,
            verdict,
            ids_out,
            offsets_out,
            values.numel(),
            lengths.numel(),
            batch,
            num_rows.numel(),
            NONE=NONE,
            NARROW=narrowed is not None,
            SANITIZE=sanitized is not None,
            BLOCK=BLOCK,
            FEATURES=min(next_power_of_2(max(num_rows.numel(), 1)), MAX_FEATURES),
            num_warps=NUM_WARPS,
        )
