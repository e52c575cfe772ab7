"""Puts up to ``NCHUNK`` contiguous byte ranges into each peer's symmetric buffer and
counts them in with the peer's ready signal for this rank.

``PROGRAMS_PER_PEER`` programs serve each destination, each putting its share of
every chunk with ``nvshmemx_putmem_nbi_block``; the last chunk's share goes with
``nvshmemx_putmem_signal_nbi_block``, which adds one to the destination's ready signal
once the program's data has landed. A destination therefore knows a step has fully
arrived when the signal reaches ``arrived(step)``: no sizes are exchanged, and one
slow block cannot be mistaken for a finished step.

Before writing, each program waits until the destination has released the slot this
step reuses (flow control): its signal must have reached ``step - wait_depth``. With
``NCHUNK=0`` the kernel is a pure release: one program per peer sets the peer's signal
for this rank to ``step``. The step is read from device memory (``step_clock``), so
that a replayed CUDA graph puts the step it replays.

A rank's puts to itself are plain copies (``COPY`` bytes at a time, in the widest words
the addresses and sizes allow), counted in with a release add to its own signal after
the block's barrier: NVSHMEM's block put to the calling PE copies through the same path
as to a peer, at a fraction of the GPU's copy bandwidth (CHANGELOG.md has the
measurement). Given the row of the rank itself (``self_row``) and a ``done`` buffer,
each share of that copy is split among ``SELF_SPLIT`` programs: ``PROGRAMS_PER_PEER``
programs, one multiprocessor each, hold too few loads in flight to copy at the GPU's
bandwidth, and the copy to the rank itself is the whole exchange at world size 1. The
last program of a share to finish (``done``, acquire-release at GPU scope) adds the
share's one to the signal, so ``arrived`` counts the same for every source. A program
whose wait for a free slot timed out neither copies nor ticks (nor counts in, unsplit):
after a timeout the exchange cannot go on, and the job restarts.

Buffers:
    peers:   int32 [P]             destination rank of program row p
    chunks:  int64 [P, NCHUNK, 3]  per chunk: destination byte offset in ``dst_base``'s
                                   buffer, source address, number of bytes (device
                                   computed, so no size ever crosses to the host)
    free:    int64 [world]         this rank's free signals: free[q] is the last step
                                   rank q released
    err:     int64 [4]             error record (see ``signals.py``)
    step:    int64 [1]             the step is ``step[0] + step_add`` (``StepRef``)
    done:    int64 [PROGRAMS]      with ``SPLIT`` > 1: programs of each share of the
                                   self row finished (zero between launches)
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels import nvshmem_device as nv
from torchrec_pgas.kernels.launch import Launcher
from torchrec_pgas.kernels.signals import WAIT_SLOT_FREE, last_to_finish, wait_ge
from torchrec_pgas.kernels.step_clock import StepRef, read_step

PROGRAMS_PER_PEER = 32
#: Programs per share of a rank's copy to itself (with ``self_row``): 32 x 16 programs
#: of ``NUM_WARPS`` warps, a few per multiprocessor.
SELF_SPLIT = 16
#: Shares start at multiples of this many bytes, so the block copies stay vectorized.
ALIGN = 16
NUM_WARPS = 4
#: Bytes a program copies at once in a put to its own rank (4 to 8 accesses per thread:
#: a wider tile holds more registers, and every program of the launch, the peers' too,
#: is compiled with the most any path needs).
COPY = 4096


@triton.jit
def _copy(d, s, count, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Copies ``count`` elements of ``s``'s type from ``s`` to ``d``: whole tiles of
    ``BLOCK`` unmasked (with ``ALIGNED``, both 16-byte aligned: 16 bytes per access; a
    masked access is one element at a time), then the rest."""
    at = tl.arange(0, BLOCK)
    whole = count - count % BLOCK
    for i in range(0, whole, BLOCK):
        d_i = d + i
        s_i = s + i
        if ALIGNED:
            d_i = tl.multiple_of(d_i, 16)
            s_i = tl.multiple_of(s_i, 16)
        tl.store(d_i + at, tl.load(s_i + at))
    rest = whole + at < count
    tl.store(d + whole + at, tl.load(s + whole + at, mask=rest), mask=rest)


@triton.jit
def copy_bytes(dst, src, size, COPY: tl.constexpr):
    """Copies ``size`` bytes from address ``src`` to address ``dst`` (both in this GPU's
    memory) in the widest words that both addresses and the size allow: ids chunks are
    8-byte aligned, lengths and weights 4-byte aligned."""
    words = dst | src | size
    if (words & 15) == 0:
        i64 = tl.pointer_type(tl.int64)
        _copy(dst.to(i64, bitcast=True), src.to(i64, bitcast=True), size // 8, COPY // 8, True)
    elif (words & 7) == 0:
        i64 = tl.pointer_type(tl.int64)
        _copy(dst.to(i64, bitcast=True), src.to(i64, bitcast=True), size // 8, COPY // 8, False)
    elif (words & 3) == 0:
        i32 = tl.pointer_type(tl.int32)
        _copy(dst.to(i32, bitcast=True), src.to(i32, bitcast=True), size // 4, COPY // 4, False)
    else:
        u8 = tl.pointer_type(tl.uint8)
        _copy(dst.to(u8, bitcast=True), src.to(u8, bitcast=True), size, COPY // 8, False)


@triton.jit
def program_share(pid, num_rows, self_row, PROGRAMS: tl.constexpr, SPLIT: tl.constexpr):
    """Program ``pid``'s row of ``peers``, its share ``j`` (the count it belongs to),
    and the part of every chunk it moves: ``part`` of ``parts`` equal parts. The rows
    of other ranks come first, ``PROGRAMS`` programs each (program ``j`` puts share
    ``j``); then, with ``SPLIT`` > 1, the self row's ``PROGRAMS * SPLIT`` (program ``k``
    of share ``j`` copies part ``j * SPLIT + k``)."""
    i = pid.to(tl.int64)
    p = i // PROGRAMS
    j = i % PROGRAMS
    parts = PROGRAMS
    part = j
    if SPLIT > 1:
        others = (num_rows - 1) * PROGRAMS
        mine = i >= others
        p = tl.where(mine, self_row, p + (p >= self_row).to(tl.int64))
        j = tl.where(mine, (i - others) // SPLIT, j)
        parts = tl.where(mine, PROGRAMS * SPLIT, PROGRAMS)
        part = tl.where(mine, i - others, j)
    return p, j, parts, part


@triton.jit
def _count_in(sig):
    tl.atomic_add(sig.to(tl.pointer_type(tl.uint64), bitcast=True), 1, sem="release", scope="sys")


@nv.uses_nvshmem
@triton.jit(do_not_specialize=["me", "num_rows", "self_row", "step_add", "wait_depth", "timeout_ns"])
def put_signal_kernel(
    peers_ptr,
    chunks_ptr,
    dst_base,
    ready_base,
    free_ptr,
    err_ptr,
    step_ptr,
    done_ptr,
    me: tl.int64,
    num_rows: tl.int64,
    self_row: tl.int64,
    step_add: tl.int64,
    wait_depth: tl.int64,
    timeout_ns: tl.int64,
    NCHUNK: tl.constexpr,
    PROGRAMS: tl.constexpr,
    SPLIT: tl.constexpr,
    ALIGN: tl.constexpr,
    COPY: tl.constexpr,
):
    p, j, parts, part = program_share(tl.program_id(0), num_rows, self_row, PROGRAMS, SPLIT)
    peer = tl.load(peers_ptr + p)
    sig = ready_base + me * 8
    step = read_step(step_ptr, step_add)
    free_target = step - wait_depth
    ok = True
    if (wait_depth > 0) & (free_target > 0):
        ok = wait_ge(free_ptr + peer, free_target, timeout_ns, err_ptr, peer, WAIT_SLOT_FREE)
    if ok:
        if NCHUNK == 0:
            nv.fence()
            nv.signal_op(sig, step.to(tl.uint64), nv.SIGNAL_SET, peer)
        for c in tl.static_range(NCHUNK):
            row = chunks_ptr + (p * NCHUNK + c) * 3
            nbytes = tl.load(row + 2)
            share = tl.cdiv(tl.cdiv(nbytes, parts), ALIGN) * ALIGN
            start = tl.minimum(part * share, nbytes)
            size = tl.minimum(share, nbytes - start)
            dst = dst_base + tl.load(row) + start
            src = tl.load(row + 1) + start
            if peer == me:
                # Symmetric addresses are this rank's own.
                copy_bytes(dst, src, size, COPY)
                if c == NCHUNK - 1:
                    # Every thread's copies are done before the count (release: the
                    # data is visible to whoever acquires the signal).
                    tl.debug_barrier()
                    if SPLIT > 1:
                        # The share's last program counts it in (the self row is this
                        # rank's only row with ``peer == me``).
                        if last_to_finish(done_ptr + j, SPLIT):
                            _count_in(sig)
                    else:
                        _count_in(sig)
            elif c < NCHUNK - 1:
                if size > 0:
                    nv.putmem_nbi_block(dst, src, size, peer)
            else:
                # Orders this program's earlier chunks before the signal.
                nv.fence()
                one = tl.full((), 1, tl.uint64)
                nv.putmem_signal_nbi_block(dst, src, size, sig, one, nv.SIGNAL_ADD, peer)


def arrived(step: int) -> int:
    """The value of a ready signal once every program of ``step`` (and of the steps
    before it) has put its data."""
    return PROGRAMS_PER_PEER * step


_launcher = Launcher(put_signal_kernel)


def grid_size(rows: int, programs: int, split: int) -> int:
    """Programs of a launch over ``rows`` rows of ``programs`` each, the self row's
    ``split`` times as many (``program_share``)."""
    return (rows + split - 1) * programs


def put_signal(
    peers: torch.Tensor,
    chunks: torch.Tensor,
    dst: torch.Tensor,
    ready: torch.Tensor,
    free: torch.Tensor,
    err: torch.Tensor,
    me: int,
    step: StepRef,
    wait_depth: int,
    timeout_ns: int,
    self_row: int = -1,
    done: Optional[torch.Tensor] = None,
) -> None:
    """Launches ``PROGRAMS_PER_PEER`` programs per row of ``peers``, or one for a pure
    release (see the module docstring); ``wait_depth`` 0: no wait for a free slot.
    With ``self_row`` (the row whose peer is ``me``) and ``done`` (int64
    ``[PROGRAMS_PER_PEER]``, zero), that row's copy runs on ``SELF_SPLIT`` times as
    many programs."""
    assert self_row < peers.numel(), f"self_row {self_row} of {peers.numel()} rows"
    nchunk = chunks.size(1) if chunks.dim() == 3 else 0
    programs = PROGRAMS_PER_PEER if nchunk else 1
    split = SELF_SPLIT if nchunk and self_row >= 0 and done is not None else 1
    _launcher[(grid_size(peers.numel(), programs, split),)](
        peers,
        chunks,
        dst.data_ptr(),
        ready.data_ptr(),
        free,
        err,
        step.word,
        done if split > 1 else free,
        me,
        peers.numel(),
        self_row,
        step.add,
        wait_depth,
        timeout_ns,
        NCHUNK=nchunk,
        PROGRAMS=programs,
        SPLIT=split,
        ALIGN=ALIGN,
        COPY=COPY,
        num_warps=NUM_WARPS,
        extern_libs=nv.bitcode_libs(),
    )
