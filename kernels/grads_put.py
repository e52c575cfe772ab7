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

Compiled with ``PUT_PATH``, an owner without a peer mapping (its slot address 0: another
node) is served through NVSHMEM: the program stores its scaled rows into a local
symmetric staging buffer laid out as one generation of the owner's slot, puts them (one
contiguous range, ``nvshmemx_putmem_nbi_block``), completes the put (``nvshmem_quiet``:
the owner must not see the count before the rows, and the staging buffer is free again
when the kernel ends) and counts in with a signal. Without ``PUT_PATH`` the kernel is
the same code as before the put path existed.

Buffers:
    grad:   [batch, pitch]  this rank's output gradient, rows of ``pitch`` elements
    dests:  int64 [P, 5]  per destination: owner rank, first column in ``grad``, dim
            (both multiples of 4), address of its gradient slot for this rank in
            generation 0 through the peer mapping (``ALIGN`` bytes aligned), address of
            its counter word for this rank through the peer mapping; with ``PUT_PATH``,
            int64 [P, PUT_DEST_WORDS]: those five (the two addresses 0 where there is no
            mapping), then the owner's PE, the symmetric address of its gradient slot
            for this rank in generation 0, the symmetric address of its counter word for
            this rank, and the address of a local symmetric staging buffer of
            ``batch_capacity`` rows of ``dim`` elements (``ALIGN`` bytes aligned)
    free:   int64 [world]  this rank's gradient free signals: free[q] is the last step
            owner q released
    err:    int64 [4]  error record (see ``signals.py``)
    step:   int64 [1]  the clock's ``GRAD`` word: this step is one more (``step_clock``:
            it picks the generation, ``DEPTH`` of them ``generation_bytes`` apart, and
            the wait for the owner's release of the step ``DEPTH`` before)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels import nvshmem_device as nv
from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.signals import WAIT_SLOT_FREE, count_in, signal_put, wait_ge
from torchrec_pgas.kernels.step_clock import StepRef, read_step

BLOCK_B = 32
BLOCK_D = 128
NUM_WARPS = 4
_DEST_WORDS = 5
#: Words of a ``dests`` row with ``PUT_PATH``.
PUT_DEST_WORDS = 9


@nv.has_put_path
@triton.jit(do_not_specialize=["batch", "generation_bytes", "step_add", "timeout_ns"])
def grads_put_kernel(
    grad_ptr,
    dests_ptr,
    free_ptr,
    err_ptr,
    step_ptr,
    batch: tl.int64,
    pitch,
    generation_bytes: tl.int64,
    scale: tl.float32,
    step_add: tl.int64,
    timeout_ns: tl.int64,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    DEST_WORDS: tl.constexpr,
    DEPTH: tl.constexpr,
    PUT_PATH: tl.constexpr = False,
):
    step = read_step(step_ptr, step_add)
    free_target = step - DEPTH
    generation_bytes = (step % DEPTH) * generation_bytes
    p = tl.program_id(0)
    blk = tl.program_id(1)
    dest = dests_ptr + p * DEST_WORDS
    ok = True
    if PUT_PATH:
        staged = tl.load(dest + 3) == 0
        pe = tl.load(dest + 5).to(tl.int32)
    if blk * BLOCK_B < batch:
        owner = tl.load(dest)
        if free_target > 0:
            ok = wait_ge(free_ptr + owner, free_target, timeout_ns, err_ptr, owner, WAIT_SLOT_FREE)
        if ok:
            col = tl.multiple_of(tl.load(dest + 1), 4)
            dim = tl.multiple_of(tl.load(dest + 2), 4)
            slot = tl.load(dest + 3) + generation_bytes
            if PUT_PATH:
                slot = tl.where(staged, tl.load(dest + 8), slot)
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
            if PUT_PATH:
                if staged:
                    size = grad_ptr.dtype.element_ty.primitive_bitwidth // 8
                    # This program's rows are one range, in the slot as in the staging buffer.
                    at = blk.to(tl.int64) * BLOCK_B * dim * size
                    n = tl.minimum(batch - blk * BLOCK_B, BLOCK_B)
                    nbytes = n * dim.to(tl.int64) * size
                    nv.putmem_nbi_block(tl.load(dest + 6) + generation_bytes + at, slot + at, nbytes, pe)
    if ok:
        if PUT_PATH:
            if staged:
                # The rows have landed before the count that publishes them.
                nv.quiet()
                signal_put(tl.load(dest + 7), 1, nv.SIGNAL_ADD, pe)
            else:
                count_in(dest + 4, 0)
        else:
            # The count address is the fifth word (``count_in`` takes a table and an index).
            count_in(dest + 4, 0)


_launcher = Launcher(grads_put_kernel)


def grads_put(
    grad: torch.Tensor,
    dests: torch.Tensor,
    free: torch.Tensor,
    err: torch.Tensor,
    batch_capacity: int,
    step: StepRef,
    depth: int,
    generation_bytes: int,
    scale: float,
    timeout_ns: int,
    *,
    put_path: bool = False,
) -> None:
    """Launches ``(P, programs_per_source(batch_capacity))`` programs for ``grad``'s
    ``grad.size(0)`` rows into generation ``step % depth`` of the owners' slots (see
    the module docstring). With ``put_path``, ``dests`` has
    ``PUT_DEST_WORDS`` words a row and owners without a peer mapping are served through
    NVSHMEM (which must be initialized)."""
    grid = (dests.size(0), programs_per_source(batch_capacity))
    words = _DEST_WORDS
    put = {}
    if put_path:
        put = nv.put_path_options("dests", dests, (dests.size(0), PUT_DEST_WORDS))
        words = PUT_DEST_WORDS
    _launcher[grid](
        grad,
        dests,
        free,
        err,
        step.word,
        grad.size(0),
        grad.stride(0),
        generation_bytes,
        scale,
        step.add,
        timeout_ns,
        BLOCK_B=BLOCK_B,
        BLOCK_D=BLOCK_D,
        ALIGN=4 * grad.element_size(),
        DEST_WORDS=words,
        DEPTH=depth,
        num_warps=NUM_WARPS,
        **put,
    )


def programs_per_source(batch_capacity: int) -> int:
    """How many counts an owner gets from each source per step."""
    return cdiv(batch_capacity, BLOCK_B)
