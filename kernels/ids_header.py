"""Writes a source's slot headers and the byte ranges ``put_signal`` sends to each owner.

One program. It reads the verdict of ``ids_check``, decides the batch's status (the
same for every owner, so every rank raises the same error) and, per owner, where its
lengths, ids and weights are in this rank's KJT. A batch that is not ``OK`` is sent as
its header alone, so owners never see bad ids. It also takes the send's step (ticks
the ``SEND`` word of the clock, ``step_clock``), whose generation of the owners' slots
the chunks point into.

An owner's features need not be contiguous in the routed KJT: they are given as runs
of consecutive features, each run sent as three chunks (lengths, ids, weights) that
land packed, one after the other, in the owner's slot. So a batch goes out in the
order the model was given it, with no permute (one run per owner when it is already
in the sharding's order).

The KJT that is routed (``values``, ``offsets``) may be another than the one
``ids_check`` checked (``check_values``, ``check_offsets``): row-wise sharding checks
the ids against the whole tables, then routes them bucketed by row block. The
problem's detail is read from the checked one.

Buffers:
    verdict:         int64 [2]           in/out: see ``ids_check``; reset to ``NONE``
    step:            int64 [1]           in/out: the last send's step; becomes this one's
    values:          int64 [n_ids]       the routed KJT's ids
    offsets:         int  [F * batch + 1] the routed KJT's offsets
    check_values:    int64 [n_ids]       the checked KJT's ids
    check_offsets:   int  [C * batch + 1] the checked KJT's offsets (C features)
    num_rows:        int64 [C]           rows of each checked feature's table
    runs:            int64 [W, R, 2]     owner w's features, in its lookup's order: R
                                         runs ``(first routed feature, count)``, padded
                                         with ``(0, 0)``
    headers:         int64 [W, 8]        out: one slot header per owner (``ids_slot``)
    chunks:          int64 [W, 3R + 1, 3] out: ``put_signal``'s chunks per owner: per
                                         run its lengths, ids and weights, then the
                                         header (the last chunk carries the signal)
"""

from typing import List, Sequence

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.ids_check import NONE
from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, IdsSlotLayout, Status
from torchrec_pgas.kernels.launch import Launcher, next_power_of_2

_OK = tl.constexpr(Status.OK.value)
_OUT_OF_RANGE = tl.constexpr(Status.ID_OUT_OF_RANGE.value)
_OVER_CAPACITY = tl.constexpr(Status.OVER_CAPACITY.value)
_BAD_LENGTHS = tl.constexpr(Status.BAD_LENGTHS.value)


@triton.jit(
    do_not_specialize=[
        "batch",
        "n_ids",
        "num_features",
        "num_check_features",
        "has_weights",
        "host_status",
        "host_d0",
        "host_d1",
        "host_d2",
        "batch_capacity",
        "ids_capacity",
        "my_slot",
        "generation_bytes",
        "lengths_offset",
        "ids_offset",
        "weights_offset",
        "lengths_addr",
        "values_addr",
        "weights_addr",
        "headers_addr",
    ]
)
def ids_header_kernel(
    verdict_ptr,
    values_ptr,
    offsets_ptr,
    check_values_ptr,
    check_offsets_ptr,
    num_rows_ptr,
    runs_ptr,
    headers_ptr,
    chunks_ptr,
    step_ptr,
    batch: tl.int64,
    n_ids: tl.int64,
    num_features: tl.int64,
    num_check_features: tl.int64,
    has_weights: tl.int64,
    host_status: tl.int64,
    host_d0: tl.int64,
    host_d1: tl.int64,
    host_d2: tl.int64,
    batch_capacity: tl.int64,
    ids_capacity: tl.int64,
    my_slot: tl.int64,
    generation_bytes: tl.int64,
    lengths_offset: tl.int64,
    ids_offset: tl.int64,
    weights_offset: tl.int64,
    lengths_addr: tl.int64,
    values_addr: tl.int64,
    weights_addr: tl.int64,
    headers_addr: tl.int64,
    W: tl.constexpr,
    BLOCK_W: tl.constexpr,
    R: tl.constexpr,
    WORDS: tl.constexpr,
    NONE: tl.constexpr,
    DEPTH: tl.constexpr,
):
    step = tl.load(step_ptr) + 1
    slot_offset = (step % DEPTH) * generation_bytes + my_slot
    w = tl.arange(0, BLOCK_W)
    wm = w < W
    zero = tl.zeros([BLOCK_W], dtype=tl.int64)
    ids_per = zero
    for r in tl.static_range(R):
        first, count, id_lo, id_hi = _run(runs_ptr, offsets_ptr, w, wm, r, batch, R)
        ids_per += id_hi - id_lo
    most_ids = tl.max(tl.where(wm, ids_per, 0))
    total = tl.load(offsets_ptr + num_features * batch).to(tl.int64)

    bad_pos = tl.load(verdict_ptr)
    negative_pos = tl.load(verdict_ptr + 1)
    # Left clean for the next batch: the verdict is reused (one warp: every thread has
    # read it before any writes).
    tl.debug_barrier()
    tl.store(verdict_ptr, NONE)
    tl.store(verdict_ptr + 1, NONE)
    tl.store(step_ptr, step)
    status, d0, d1, d2 = batch_status(
        bad_pos,
        negative_pos,
        check_values_ptr,
        check_offsets_ptr,
        num_rows_ptr,
        num_check_features,
        batch,
        n_ids,
        total,
        (most_ids > ids_capacity) | (batch > batch_capacity),
        most_ids,
        host_status,
        host_d0,
        host_d1,
        host_d2,
        NONE,
    )
    ok = status == _OK

    h = headers_ptr + w * WORDS
    tl.store(h, zero + status, mask=wm)
    tl.store(h + 1, zero + tl.where(batch <= batch_capacity, batch, 0), mask=wm)
    tl.store(h + 2, tl.where(ok, ids_per, 0), mask=wm)
    tl.store(h + 3, zero + has_weights, mask=wm)
    tl.store(h + 4, zero + d0, mask=wm)
    tl.store(h + 5, zero + d1, mask=wm)
    tl.store(h + 6, zero + d2, mask=wm)
    tl.store(h + 7, zero, mask=wm)

    # Each run lands right after the one before it in the owner's slot.
    rows_before = zero
    ids_before = zero
    for r in tl.static_range(R):
        first, count, id_lo, id_hi = _run(runs_ptr, offsets_ptr, w, wm, r, batch, R)
        n = id_hi - id_lo
        c = chunks_ptr + (w * (3 * R + 1) + 3 * r) * 3
        tl.store(c + 0, slot_offset + lengths_offset + rows_before * 4, mask=wm)
        tl.store(c + 1, lengths_addr + first * batch * 4, mask=wm)
        tl.store(c + 2, tl.where(ok, count * batch * 4, 0), mask=wm)
        tl.store(c + 3, slot_offset + ids_offset + ids_before * 8, mask=wm)
        tl.store(c + 4, values_addr + id_lo * 8, mask=wm)
        tl.store(c + 5, tl.where(ok, n * 8, 0), mask=wm)
        tl.store(c + 6, slot_offset + weights_offset + ids_before * 4, mask=wm)
        tl.store(c + 7, weights_addr + id_lo * 4, mask=wm)
        tl.store(c + 8, tl.where(ok & (has_weights != 0), n * 4, 0), mask=wm)
        rows_before += count * batch
        ids_before += n
    c = chunks_ptr + (w * (3 * R + 1) + 3 * R) * 3
    tl.store(c + 0, zero + slot_offset, mask=wm)
    tl.store(c + 1, headers_addr + w.to(tl.int64) * WORDS * 8, mask=wm)
    tl.store(c + 2, zero + WORDS * 8, mask=wm)


@triton.jit
def batch_status(
    bad_pos,
    negative_pos,
    check_values_ptr,
    check_offsets_ptr,
    num_rows_ptr,
    num_check_features,
    batch,
    n_ids,
    total,
    over,
    most_ids,
    host_status,
    host_d0,
    host_d1,
    host_d2,
    NONE: tl.constexpr,
):
    """A batch's status and detail words (``ids_slot.Status``) from ``ids_check``'s
    verdict (``bad_pos``, ``negative_pos``), its lengths' sum ``total`` against its
    ``n_ids`` ids, whether it is ``over`` capacity (``most_ids`` ids for one owner),
    and a problem the host found (``host_status`` >= 0), which overrides all."""
    has_bad = bad_pos < NONE
    feature = num_check_features * 0
    # The bad id's feature is looked for only where there is one: a good batch's step
    # (most steps) waits on no load per feature.
    for f in range(tl.where(has_bad, num_check_features, 0)):
        feature = tl.where(tl.load(check_offsets_ptr + f * batch) <= bad_pos, f, feature)
    bad_id = tl.load(check_values_ptr + tl.where(has_bad, bad_pos, 0), mask=has_bad, other=0)

    # Later checks win: a batch that fails several reports the most basic problem.
    status = tl.where(has_bad, _OUT_OF_RANGE, _OK)
    d0 = tl.where(has_bad, feature, 0).to(tl.int64)
    d1 = tl.where(has_bad, bad_id, 0).to(tl.int64)
    d2 = tl.where(has_bad, tl.load(num_rows_ptr + feature), 0)
    status = tl.where(over, _OVER_CAPACITY, status)
    d0 = tl.where(over, batch, d0)
    d1 = tl.where(over, most_ids, d1)
    d2 = tl.where(over, 0, d2)
    bad_lengths = (negative_pos < NONE) | (total != n_ids)
    status = tl.where(bad_lengths, _BAD_LENGTHS, status)
    d0 = tl.where(bad_lengths, tl.where(negative_pos < NONE, negative_pos // tl.maximum(batch, 1), -1), d0)
    d1 = tl.where(bad_lengths, 0, d1)
    d2 = tl.where(bad_lengths, 0, d2)
    on_host = host_status >= 0
    status = tl.where(on_host, host_status, status)
    d0 = tl.where(on_host, host_d0, d0)
    d1 = tl.where(on_host, host_d1, d1)
    d2 = tl.where(on_host, host_d2, d2)
    return status, d0, d1, d2


@triton.jit
def _run(runs_ptr, offsets_ptr, w, wm, r, batch, R: tl.constexpr):
    """Run ``r`` of every owner: its first routed feature, its number of features,
    and the range of its ids in the routed KJT."""
    row = runs_ptr + (w * R + r) * 2
    first = tl.load(row, mask=wm, other=0)
    count = tl.load(row + 1, mask=wm, other=0)
    id_lo = tl.load(offsets_ptr + first * batch, mask=wm, other=0).to(tl.int64)
    id_hi = tl.load(offsets_ptr + (first + count) * batch, mask=wm, other=0).to(tl.int64)
    return first, count, id_lo, id_hi


def runs_of(features: Sequence[int]) -> List[List[int]]:
    """``features`` cut into runs of consecutive features, as ``[first, count]``."""
    runs: List[List[int]] = []
    for f in features:
        if runs and sum(runs[-1]) == f:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])
    return runs


def feature_runs(routed: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """The ``runs`` argument for owners whose routed features are ``routed[w]``: each
    list cut into runs (``runs_of``), padded to the most runs."""
    runs = [runs_of(features) for features in routed]
    most = max([1] + [len(r) for r in runs])
    return torch.tensor([r + [[0, 0]] * (most - len(r)) for r in runs], dtype=torch.int64, device=device)


_launcher = Launcher(ids_header_kernel)


def ids_header(
    verdict: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    weights: "torch.Tensor | None",
    num_rows: torch.Tensor,
    runs: torch.Tensor,
    headers: torch.Tensor,
    chunks: torch.Tensor,
    batch: int,
    host_problem: "tuple | None",
    layout: IdsSlotLayout,
    step: torch.Tensor,
    source: int,
    depth: int,
    checked: "tuple[torch.Tensor, torch.Tensor] | None" = None,
) -> None:
    """Fills ``headers`` and ``chunks`` for one batch (see the module docstring), sent
    by rank ``source`` into generation ``step % depth`` of the owners' ``[depth, W]``
    slots, ``step`` being the send's (``step[0]``, ticked).
    ``host_problem`` is ``(Status, detail)`` of a problem the host found, if any;
    ``checked`` the ``(values, offsets)`` that ``ids_check`` checked, if not the routed
    ones."""
    world = headers.size(0)
    status, detail = host_problem if host_problem is not None else (-1, ())
    d0, d1, d2 = (list(detail) + [0, 0, 0])[:3]
    check_values, check_offsets = checked if checked is not None else (values, offsets)
    _launcher[(1,)](
        verdict,
        values,
        offsets,
        check_values,
        check_offsets,
        num_rows,
        runs,
        headers,
        chunks,
        step,
        batch,
        values.numel(),
        lengths.numel() // max(batch, 1),
        num_rows.numel(),
        int(weights is not None),
        int(status),
        d0,
        d1,
        d2,
        layout.batch_capacity,
        layout.ids_capacity,
        source * layout.nbytes,
        world * layout.nbytes,
        layout.lengths_offset,
        layout.ids_offset,
        layout.weights_offset,
        lengths.data_ptr(),
        values.data_ptr(),
        weights.data_ptr() if weights is not None else values.data_ptr(),
        headers.data_ptr(),
        W=world,
        BLOCK_W=next_power_of_2(world),
        R=runs.size(1),
        WORDS=HEADER_WORDS,
        NONE=NONE,
        DEPTH=depth,
        num_warps=1,
    )
