"""Puts up to ``NCHUNK`` contiguous byte ranges into each peer's symmetric buffer, then
sets the peer's ready signal for this rank to the step number.

One program per destination. The program first waits until the destination has
released the slot this step reuses (flow control), puts every chunk with
``nvshmemx_putmem_nbi_block``, orders them with ``nvshmem_fence`` and then sets the
signal, so the destination sees the data before the signal. With ``NCHUNK=0`` it is a
pure signal (a slot release).

Buffers:
    peers:   int32 [P]             destination rank of program p
    chunks:  int64 [P, NCHUNK, 3]  per chunk: destination byte offset in ``dst_base``'s
                                   buffer, source address, number of bytes (device
                                   computed, so no size ever crosses to the host)
    free:    int64 [world]         this rank's free signals: free[q] is the last step
                                   rank q released
    err:     int64 [4]             error record (see ``signals.py``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels import nvshmem_device as nv
from torchrec_pgas.kernels.signals import WAIT_SLOT_FREE, wait_ge

NUM_WARPS = 4


@nv.uses_nvshmem
@triton.jit(do_not_specialize=["me", "step", "free_target", "timeout_ns"])
def put_signal_kernel(
    peers_ptr,
    chunks_ptr,
    dst_base,
    ready_base,
    free_ptr,
    err_ptr,
    me,
    step,
    free_target,
    timeout_ns,
    NCHUNK: tl.constexpr,
):
    p = tl.program_id(0)
    peer = tl.load(peers_ptr + p)
    ok = True
    if free_target > 0:
        ok = wait_ge(free_ptr + peer, free_target, timeout_ns, err_ptr, peer, WAIT_SLOT_FREE)
    if ok:
        for c in tl.static_range(NCHUNK):
            row = chunks_ptr + (p * NCHUNK + c) * 3
            nbytes = tl.load(row + 2)
            if nbytes > 0:
                nv.putmem_nbi_block(dst_base + tl.load(row), tl.load(row + 1), nbytes, peer)
        nv.fence()
        nv.signal_op(ready_base + me.to(tl.int64) * 8, step.to(tl.uint64), nv.SIGNAL_SET, peer)


def put_signal(
    peers: torch.Tensor,
    chunks: torch.Tensor,
    dst: torch.Tensor,
    ready: torch.Tensor,
    free: torch.Tensor,
    err: torch.Tensor,
    me: int,
    step: int,
    free_target: int,
    timeout_ns: int,
) -> None:
    """Launches one program per entry of ``peers`` (see the module docstring)."""
    nchunk = chunks.size(1) if chunks.dim() == 3 else 0
    put_signal_kernel[(peers.numel(),)](
        peers, chunks, dst.data_ptr(), ready.data_ptr(), free, err,
        me, step, free_target, timeout_ns, NCHUNK=nchunk, num_warps=NUM_WARPS,
        extern_libs=nv.bitcode_libs(),
    )
