"""Puts a requester's output gradient back to the owners of its columns: the backward
of ``rows_put``.

Program ``(p, blk)`` takes rows ``blk * BLOCK_B ...`` of destination ``p``'s columns of
``grad`` (``grad[:, col:col + dim]``), scales them by ``scale`` (TorchRec's gradient
division: a multiplication by ``1 / world`` in fp32, as torch divides by a scalar) and
stores them straight into the owner's gradient slot for this rank through its peer
mapping (NVLink), as rows of ``dim`` elements. It then adds one to the owner's counter
for this rank with release semantics at system scope (unless its wait for the slot timed
out). Every program counts in, rows or none, so an owner expects
``cdiv(batch_capacity, BLOCK_B)`` counts from every source at every step without
knowing their batch sizes.

An owner's slots of one step are therefore ``[S * batch_capacity, dim]`` rows,
source-major, the gradient FBGEMM's backward takes: the owner reads them without a copy
(rows past a source's batch belong to empty bags, which FBGEMM never reads).

Buffers:
    grad:   [batch, pitch]  this rank's output gradient, rows of ``pitch`` elements
    dests:  int64 [P, 5]  per destination: owner rank, first column in ``grad``, dim
            (both multiples of 4), address of its gradient slot for this rank in
            generation 0 through the peer mapping (``ALIGN`` bytes aligned), address of
            its counter word for this rank through the peer mapping
    free:   int64 [world]  this rank's gradient free signals: free[q] is the last step
            owner q released
    err:    int64 [4]  error record (see ``signals.py``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.signals import WAIT_SLOT_FREE, count_in, wait_ge

BLOCK_B = 32
BLOCK_D = 128
NUM_WARPS = 4
_DEST_WORDS = 5


@triton.jit(do_not_specialize=["batch", "generation_bytes", "free_target", "timeout_ns"])
def grads_put_kernel(
    grad_ptr,
    dests_ptr,
    free_ptr,
    err_ptr,
    batch: tl.int64,
    pitch,
    generation_bytes: tl.int64,
    scale: tl.float32,
    free_target: tl.int64,
    timeout_ns: tl.int64,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    DEST_WORDS: tl.constexpr,
):
    p = tl.program_id(0)
    blk = tl.program_id(1)
    dest = dests_ptr + p * DEST_WORDS
    ok = True
    if blk * BLOCK_B < batch:
        owner = tl.load(dest)
        if free_target > 0:
            ok = wait_ge(free_ptr + owner, free_target, timeout_ns, err_ptr, owner, WAIT_SLOT_FREE)
        if ok:
            col = tl.multiple_of(tl.load(dest + 1), 4)
            dim = tl.multiple_of(tl.load(dest + 2), 4)
            slot = tl.load(dest + 3) + generation_bytes
            out = tl.multiple_of(slot.to(grad_ptr.dtype, bitcast=True), ALIGN)
            rows = blk * BLOCK_B + tl.arange(0, BLOCK_B)
            row_ok = rows < batch
            src_rows = rows.to(tl.int64) * pitch + col
            dst_rows = rows.to(tl.int64) * dim
            for d0 in range(0, dim, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = row_ok[:, None] & (cols < dim)[None, :]
                vals = tl.load(grad_ptr + src_rows[:, None] + cols[None, :], mask=mask)
                scaled = (vals.to(tl.float32) * scale).to(vals.dtype)
                tl.store(out + dst_rows[:, None] + cols[None, :], scaled, mask=mask)
            # Every thread's stores are issued before the one release below.
            tl.debug_barrier()
    if ok:
        # The count address is the fifth word (``count_in`` takes a table and an index).
        count_in(dest + 4, 0)


_launcher = Launcher(grads_put_kernel)


def grads_put(
    grad: torch.Tensor,
    dests: torch.Tensor,
    free: torch.Tensor,
    err: torch.Tensor,
    batch_capacity: int,
    generation_bytes: int,
    scale: float,
    free_target: int,
    timeout_ns: int,
) -> None:
    """Launches ``(P, programs_per_source(batch_capacity))`` programs for ``grad``'s
    ``grad.size(0)`` rows (see the module docstring)."""
    grid = (dests.size(0), programs_per_source(batch_capacity))
    _launcher[grid](
        grad, dests, free, err, grad.size(0), grad.stride(0), generation_bytes, scale, free_target, timeout_ns,
        BLOCK_B=BLOCK_B, BLOCK_D=BLOCK_D, ALIGN=4 * grad.element_size(), DEST_WORDS=_DEST_WORDS,
        num_warps=NUM_WARPS,
    )


def programs_per_source(batch_capacity: int) -> int:
    """How many counts an owner gets from each source per step."""
    return cdiv(batch_capacity, BLOCK_B)
