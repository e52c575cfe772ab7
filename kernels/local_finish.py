"""Ends a step served without an exchange (a world of one rank): a bad batch's output
(an id out of range, a negative length, lengths that do not add up to the ids, or a
problem the host found) becomes NaN, and the step's header (``ids_slot.Header``:
status and detail, decided as ``ids_header`` decides them) goes to the step's entry
of the ring in pinned host memory (``step_records``), which the host reads without
waiting for the device. It then leaves the verdict clean for the next batch and ticks
the step clock.

It is one program: a good batch's step (most steps) only reads the verdict and writes
the record, and a single program does that with no count of finished programs (an
atomic on the step's critical path); a bad batch's NaN outputs need not be fast.

Buffers:
    out:       float [n_out]           in/out: the step's pooled rows; NaN if bad
    verdict:   int64 [2]               in/out: ``ids_check``'s; reset to ``NONE``
    values:    int   [n_ids]           the batch's ids (the detail of a bad one)
    offsets:   int   [F * batch + 1]   the batch's offsets
    num_rows:  int64 [F]               rows of each feature's table
    clock:     int64 [1]               in/out: the steps served; ticked
    ring:      int64 [RING, WORDS + 1] host memory (pinned: an address the device
                                       writes): entry ``step % RING`` gets the header,
                                       then the step
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.ids_check import NONE
from torchrec_pgas.kernels.ids_header import batch_status
from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Status
from torchrec_pgas.kernels.launch import Launcher

BLOCK = 1024
NUM_WARPS = 4

_OK = tl.constexpr(Status.OK.value)


@triton.jit(
    do_not_specialize=[
        "ring_addr",
        "n_out",
        "n_ids",
        "batch",
        "num_features",
        "host_status",
        "host_d0",
        "host_d1",
        "host_d2",
        "has_weights",
    ]
)
def local_finish_kernel(
    out_ptr,
    verdict_ptr,
    values_ptr,
    offsets_ptr,
    num_rows_ptr,
    clock_ptr,
    ring_addr: tl.int64,
    n_out: tl.int64,
    n_ids: tl.int64,
    batch: tl.int64,
    num_features: tl.int64,
    host_status: tl.int64,
    host_d0: tl.int64,
    host_d1: tl.int64,
    host_d2: tl.int64,
    has_weights: tl.int64,
    NONE: tl.constexpr,
    RING: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    bad_pos = tl.load(verdict_ptr)
    negative_pos = tl.load(verdict_ptr + 1)
    total = tl.load(offsets_ptr + num_features * batch).to(tl.int64)
    # Decided as the header of an exchange's slot would say.
    status, d0, d1, d2 = batch_status(
        bad_pos,
        negative_pos,
        values_ptr,
        offsets_ptr,
        num_rows_ptr,
        num_features,
        batch,
        n_ids,
        total,
        False,
        0,
        host_status,
        host_d0,
        host_d1,
        host_d2,
        NONE,
    )
    if status != _OK:
        nan = tl.full([BLOCK], float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
        for start in range(0, n_out, BLOCK):
            k = start + tl.arange(0, BLOCK)
            tl.store(out_ptr + k, nan, mask=k < n_out)
    # Every thread has read the verdict before it is reset.
    tl.debug_barrier()
    tl.store(verdict_ptr, NONE)
    tl.store(verdict_ptr + 1, NONE)
    step = tl.load(clock_ptr) + 1
    tl.store(clock_ptr, step)
    entry = ring_addr.to(tl.pointer_type(tl.int64), bitcast=True) + (step % RING) * (WORDS + 1)
    tl.store(entry, status.to(tl.int64))
    tl.store(entry + 1, batch)
    tl.store(entry + 2, tl.where(status == _OK, n_ids, 0))
    tl.store(entry + 3, has_weights)
    tl.store(entry + 4, d0.to(tl.int64))
    tl.store(entry + 5, d1.to(tl.int64))
    tl.store(entry + 6, d2.to(tl.int64))
    for i in range(7, WORDS):
        tl.store(entry + i, 0)
    # The step last, released at system scope: the host reads it first.
    tl.atomic_xchg(entry + WORDS, step, sem="release", scope="sys")


_launcher = Launcher(local_finish_kernel)


def local_finish(
    out: torch.Tensor,
    verdict: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    num_rows: torch.Tensor,
    clock: torch.Tensor,
    ring: torch.Tensor,
    batch: int,
    has_weights: bool,
    host_problem: Optional[Tuple[Status, Tuple[int, ...]]] = None,
) -> None:
    """Ends the step of a batch of ``batch`` samples (see the module docstring).
    ``host_problem``: ``(Status, detail)`` of a problem the host found, whose batch was
    not checked or looked up (``values`` and ``offsets`` are then not read: pass any
    int64 tensor)."""
    if ring.dim() != 2 or ring.size(1) != HEADER_WORDS + 1 or ring.dtype != torch.int64:
        raise ValueError(f"ring: int64 [n, {HEADER_WORDS + 1}] expected, got {ring.dtype} {list(ring.shape)}")
    status, detail = host_problem if host_problem is not None else (-1, ())
    d0, d1, d2 = (list(detail) + [0, 0, 0])[:3]
    num_features = 0 if host_problem is not None else (offsets.numel() - 1) // max(batch, 1)
    n_out = out.numel()
    _launcher[(1,)](
        out,
        verdict,
        values,
        offsets,
        num_rows,
        clock,
        ring.data_ptr(),
        n_out,
        values.numel() if host_problem is None else 0,
        batch,
        num_features,
        int(status),
        d0,
        d1,
        d2,
        int(has_weights),
        NONE=NONE,
        RING=ring.size(0),
        WORDS=HEADER_WORDS,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
