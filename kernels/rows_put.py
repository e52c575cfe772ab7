"""Puts pooled rows at their final place in each requester's output.

The owner's lookup produced ``src`` with one block of ``batch_capacity`` rows per
requester (rows past the requester's batch size are padding). Program ``(s, blk)``
stores rows ``blk * BLOCK_B ...`` of requester ``s`` straight into ``s``'s output
through its peer mapping (NVLink), at the column block of this owner's tables (this
rank's own rows, ``s == me``, straight into its output tensor ``own`` instead, which
``output_take`` then need not copy out of a slot), then adds one to ``s``'s counter
for this owner with release semantics at system scope. A
requester knows how many programs serve it (``cdiv(its batch, BLOCK_B)``), so it waits
for its counter to reach the running total.

Compiled with ``PUT_PATH``, a requester without a peer mapping (its ``out_addrs`` entry
0: another node) is served through NVSHMEM instead: the program stores its rows into a
local symmetric staging buffer laid out as the requester's output slot, puts each row
there (``nvshmemx_putmem_nbi_block``), completes the puts (``nvshmem_quiet``: the
requester must not see the count before the rows, and the staging buffer is free again
when the kernel ends) and then adds the one to the requester's counter with a signal.
Requesters with a mapping get the direct stores either way; without ``PUT_PATH`` the
kernel is the same code as before the put path existed.

Buffers:
    src:       [S * batch_capacity, dim] pooled rows, requester-major (dim a multiple
               of 4)
    batch:     int64 [S]  batch size of each requester (from its ids header), every
                          ``batch_stride`` words
    own:       [batch, pitch], rows ``own_pitch`` apart (``src``'s dtype)  this rank's
                          output: requester ``me``'s rows go there instead of its
                          slot (a column slice of the module's joined output, or
                          contiguous)
    out_addrs: int64 [DEPTH, S]  per generation, the address of each requester's
                          output slot (``ALIGN`` bytes aligned), rows of ``pitch``
                          elements, the owner's block from column ``col`` (both
                          multiples of 4), through the peer mapping; with
                          ``PUT_PATH``, int64 [DEPTH, PUT_ROWS, S]: that row (0 where
                          there is no mapping), then
                          per requester its PE, the symmetric address of its output
                          slot, the symmetric address of its counter word for this
                          owner, and the address of a local symmetric staging buffer
                          laid out as its output slot (read only where row 0 is 0)
    cnt_addrs: int64 [S]  address of each requester's counter word for this owner
                          (unused for a requester served by puts)
    free:      int64 [S]  this rank's free signals: free[s] is the last step s released
    err:       int64 [4]  error record (see ``signals.py``)
    out_step:  int64 [1]  the clock's ``OUT`` word: this step is one more
                          (``step_clock``; it picks the generation and the wait)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels import nvshmem_device as nv
from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.signals import WAIT_OUT_FREE, count_in, put_rows, signal_put, wait_ge

BLOCK_B = 32
BLOCK_D = 128
NUM_WARPS = 4
#: Rows of the ``out_addrs`` table with ``PUT_PATH`` (``lookup_put``'s too): the
#: addresses through the peer mapping, PEs, symmetric output slots, symmetric counter
#: words, local staging buffers.
PUT_ROWS = 5
_PUT_ROWS = tl.constexpr(PUT_ROWS)


# dim, pitch and col are specialized: Triton then knows when they are multiples of 16
# and moves 4 elements at once.
@nv.has_put_path
@triton.jit(do_not_specialize=["batch_stride", "batch_capacity", "timeout_ns", "me"])
def rows_put_kernel(
    src_ptr,
    batch_ptr,
    batch_stride: tl.int64,
    own_ptr,
    me: tl.int64,
    out_addrs_ptr,
    cnt_addrs_ptr,
    free_ptr,
    err_ptr,
    out_step_ptr,
    batch_capacity: tl.int64,
    dim,
    pitch,
    own_pitch,
    col,
    timeout_ns: tl.int64,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    DEPTH: tl.constexpr,
    PUT_PATH: tl.constexpr = False,
):
    s = tl.program_id(0)
    blk = tl.program_id(1)
    out_step = tl.load(out_step_ptr) + 1
    free_target = out_step - DEPTH
    if PUT_PATH:
        out_addrs_ptr += (out_step % DEPTH) * _PUT_ROWS * tl.num_programs(0)
    else:
        out_addrs_ptr += (out_step % DEPTH) * tl.num_programs(0)
    batch = tl.load(batch_ptr + s * batch_stride)
    if blk * BLOCK_B < batch:
        ok = True
        if (free_target > 0) & (s != me):  # this rank's own rows go to its output, not a slot
            ok = wait_ge(free_ptr + s, free_target, timeout_ns, err_ptr, s, WAIT_OUT_FREE)
        if ok:
            out_addr = tl.load(out_addrs_ptr + s)
            if PUT_PATH:
                S = tl.num_programs(0)
                staged = out_addr == 0
                out_addr = tl.where(staged, tl.load(out_addrs_ptr + 4 * S + s), out_addr)
            out = tl.multiple_of(tl.where(s == me, own_ptr, out_addr.to(src_ptr.dtype, bitcast=True)), ALIGN)
            rows = blk * BLOCK_B + tl.arange(0, BLOCK_B)
            row_ok = rows < batch
            src_rows = (s * batch_capacity + rows).to(tl.int64) * dim
            # Multiples of 4 elements (``check_own``), told so whatever the row strides'
            # specialization: the stores then move 4 elements at once.
            dst_rows = tl.multiple_of(rows.to(tl.int64) * tl.where(s == me, own_pitch, pitch) + col, 4)
            for d0 in range(0, dim, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = row_ok[:, None] & (cols < dim)[None, :]
                vals = tl.load(src_ptr + src_rows[:, None] + cols[None, :], mask=mask)
                tl.store(out + dst_rows[:, None] + cols[None, :], vals, mask=mask)
            # Every thread's stores are issued before the one release below.
            tl.debug_barrier()
            if PUT_PATH:
                if staged:
                    pe = tl.load(out_addrs_ptr + S + s).to(tl.int32)
                    size = src_ptr.dtype.element_ty.primitive_bitwidth // 8
                    at = col.to(tl.int64) * size
                    dst = tl.load(out_addrs_ptr + 2 * S + s) + at
                    n = tl.minimum(batch - blk * BLOCK_B, BLOCK_B)
                    put_rows(
                        dst, out_addr + at, pitch.to(tl.int64) * size, dim.to(tl.int64) * size, blk * BLOCK_B, n, pe
                    )
                    nv.quiet()
                    signal_put(tl.load(out_addrs_ptr + 3 * S + s), 1, nv.SIGNAL_ADD, pe)
                else:
                    count_in(cnt_addrs_ptr, s)
            else:
                count_in(cnt_addrs_ptr, s)


_launcher = Launcher(rows_put_kernel)


def rows_put(
    src: torch.Tensor,
    batch: torch.Tensor,
    own: torch.Tensor,
    me: int,
    out_addrs: torch.Tensor,
    cnt_addrs: torch.Tensor,
    free: torch.Tensor,
    err: torch.Tensor,
    clock_out: torch.Tensor,
    batch_capacity: int,
    pitch: int,
    col: int,
    timeout_ns: int,
    *,
    put_path: bool = False,
) -> None:
    """Launches ``(S, cdiv(batch_capacity, BLOCK_B))`` programs (see module docstring)
    for the output step after ``clock_out[0]``. With ``put_path``, ``out_addrs`` is the
    ``[DEPTH, PUT_ROWS, S]`` table and requesters without a peer mapping are served
    through NVSHMEM (which must be initialized). ``own`` (this rank's output, rank
    ``me``'s batch rows of ``pitch``, ``src``'s dtype, ``check_own``) takes ``me``'s
    rows."""
    depth, S, dim = out_addrs.size(0), batch.numel(), src.size(1)
    check_own(own, pitch, src.dtype)
    grid = (S, cdiv(batch_capacity, BLOCK_B))
    put = nv.put_path_options("out_addrs", out_addrs, (depth, PUT_ROWS, S)) if put_path else {}
    _launcher[grid](
        src,
        batch,
        batch.stride(0),
        own,
        me,
        out_addrs,
        cnt_addrs,
        free,
        err,
        clock_out,
        batch_capacity,
        dim,
        pitch,
        own.stride(0),
        col,
        timeout_ns,
        BLOCK_B=BLOCK_B,
        BLOCK_D=BLOCK_D,
        ALIGN=4 * src.element_size(),
        DEPTH=depth,
        num_warps=NUM_WARPS,
        **put,
    )


def check_own(own: torch.Tensor, pitch: int, dtype: torch.dtype) -> None:
    """Refuses a rank's output that the put kernels cannot store its own rows into:
    anything but ``dtype`` rows of ``pitch`` contiguous elements, rows a multiple of 4
    elements apart from a start aligned to 4 elements (a column slice of a wider output
    whose columns are FBGEMM's dims is one: the kernels move 4 elements at once)."""
    align = 4 * own.element_size()
    if (
        own.dim() != 2
        or own.size(1) != pitch
        or own.dtype != dtype
        or (own.size(0) > 1 and own.stride(0) < pitch)
        or (own.numel() > 0 and (own.stride(1) != 1 or own.stride(0) % 4 or own.data_ptr() % align))
    ):
        raise ValueError(
            f"own: {dtype} rows of {pitch} contiguous elements, 4-element aligned, expected, got "
            f"{own.dtype} {list(own.shape)} strides {own.stride()}"
        )


def programs_per_requester(batch_size: int) -> int:
    """How many programs of one owner serve a requester of ``batch_size`` samples."""
    return cdiv(batch_size, BLOCK_B)
