"""Puts pooled rows at their final place in each requester's output.

The owner's lookup produced ``src`` with one block of ``batch_capacity`` rows per
requester (rows past the requester's batch size are padding). Program ``(s, blk)``
stores rows ``blk * BLOCK_B ...`` of requester ``s`` straight into ``s``'s output
through its peer mapping (NVLink), at the column block of this owner's tables, then
adds one to ``s``'s counter for this owner with release semantics at system scope. A
requester knows how many programs serve it (``cdiv(its batch, BLOCK_B)``), so it waits
for its counter to reach the running total.

Buffers:
    src:       [S * batch_capacity, dim] pooled rows, requester-major (dim a multiple
               of 4)
    batch:     int64 [S]  batch size of each requester (from its ids header), every
                          ``batch_stride`` words
    out_addrs: int64 [S]  address of each requester's output slot of this step
                          (``ALIGN`` bytes aligned), rows of ``pitch`` elements, the
                          owner's block from column ``col`` (both multiples of 4),
                          through the peer mapping
    cnt_addrs: int64 [S]  address of each requester's counter word for this owner
    free:      int64 [S]  this rank's free signals: free[s] is the last step s released
    err:       int64 [4]  error record (see ``signals.py``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.signals import WAIT_OUT_FREE, count_in, wait_ge

BLOCK_B = 32
BLOCK_D = 128
NUM_WARPS = 4


# dim, pitch and col are specialized: Triton then knows when they are multiples of 16
# and moves 4 elements at once.
@triton.jit(do_not_specialize=["batch_stride", "batch_capacity", "free_target", "timeout_ns"])
def rows_put_kernel(
    src_ptr,
    batch_ptr,
    batch_stride: tl.int64,
    out_addrs_ptr,
    cnt_addrs_ptr,
    free_ptr,
    err_ptr,
    batch_capacity: tl.int64,
    dim,
    pitch,
    col,
    free_target: tl.int64,
    timeout_ns: tl.int64,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
):
    s = tl.program_id(0)
    blk = tl.program_id(1)
    batch = tl.load(batch_ptr + s * batch_stride)
    if blk * BLOCK_B < batch:
        ok = True
        if free_target > 0:
            ok = wait_ge(free_ptr + s, free_target, timeout_ns, err_ptr, s, WAIT_OUT_FREE)
        if ok:
            out = tl.multiple_of(tl.load(out_addrs_ptr + s).to(src_ptr.dtype, bitcast=True), ALIGN)
            rows = blk * BLOCK_B + tl.arange(0, BLOCK_B)
            row_ok = rows < batch
            src_rows = (s * batch_capacity + rows).to(tl.int64) * dim
            dst_rows = rows.to(tl.int64) * pitch + col
            for d0 in range(0, dim, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = row_ok[:, None] & (cols < dim)[None, :]
                vals = tl.load(src_ptr + src_rows[:, None] + cols[None, :], mask=mask)
                tl.store(out + dst_rows[:, None] + cols[None, :], vals, mask=mask)
            # Every thread's stores are issued before the one release below.
            tl.debug_barrier()
            count_in(cnt_addrs_ptr, s)


_launcher = Launcher(rows_put_kernel)


def rows_put(
    src: torch.Tensor,
    batch: torch.Tensor,
    out_addrs: torch.Tensor,
    cnt_addrs: torch.Tensor,
    free: torch.Tensor,
    err: torch.Tensor,
    batch_capacity: int,
    pitch: int,
    col: int,
    free_target: int,
    timeout_ns: int,
) -> None:
    """Launches ``(S, cdiv(batch_capacity, BLOCK_B))`` programs (see module docstring)."""
    S, dim = batch.numel(), src.size(1)
    grid = (S, cdiv(batch_capacity, BLOCK_B))
    _launcher[grid](
        src, batch, batch.stride(0), out_addrs, cnt_addrs, free, err,
        batch_capacity, dim, pitch, col, free_target, timeout_ns,
        BLOCK_B=BLOCK_B, BLOCK_D=BLOCK_D, ALIGN=4 * src.element_size(), num_warps=NUM_WARPS,
    )


def programs_per_requester(batch_size: int) -> int:
    """How many programs of one owner serve a requester of ``batch_size`` samples."""
    return cdiv(batch_size, BLOCK_B)
