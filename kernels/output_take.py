"""Takes a requester's output of one step out of its output slot: waits for every
owner's rows, copies them into the output (adding the owners' partial sums in rank
order, for row-wise), then hands the slot back to the owners, and the ids slots back
to their sources when the lookup pooled straight from them. One launch, since a step's
time is mostly the host's and each launch costs the host more than the device.

Program ``(blk, c)`` waits until every owner's counter for this rank has reached
``target`` (not once the error record holds an error, such as another program's timed
out wait: the programs would otherwise time out wave after wave), then writes rows ``blk * BLOCK_B ...`` and columns
``c * BLOCK_D ...`` of ``out``: ``slot[0] + slot[1] + ...`` over the ``BLOCKS`` blocks,
added in that order in fp32 and rounded to the output dtype after each addition, as
torch adds tensors. The programs tick ``done`` (acquire-release at GPU scope); the last
one resets it, copies the error record to ``record[at:]`` and releases the slots: it
stores ``out_step`` into every owner's free word for this rank, and ``ids_step`` (if
nonzero) into every source's, with release semantics at system scope (cumulative: after
every program's reads of the slot).

Compiled with ``PUT_PATH``, a free word whose address is 0 (a peer without a peer
mapping: another node) is set through NVSHMEM instead, with a signal (one per program:
``SIGNAL_SET`` of the same value), sent after the tick that orders every program's reads
before it. Without ``PUT_PATH`` the kernel is the same code as before the put path
existed.

Buffers:
    slot:      [BLOCKS, rows, pitch]  this step's output slot, one block per owner that
               stores into it (table-wise: one block)
    out:       [batch, pitch]  out
    counts:    int64 [world]  this rank's output counters, one word per owner
    owners:    int32 [P]  the owners to wait for
    out_free:  int64 [P]  address of each owner's output free word for this rank
               (peer mapping); with ``PUT_PATH``, int64 [PUT_ROWS, P]: that row (0 where
               there is no mapping), each owner's PE, and the symmetric address of the
               word
    ids_free:  int64 [S]  address of each source's ids free word for this rank (peer
               mapping); with ``PUT_PATH``, int64 [PUT_ROWS, S], as ``out_free``
    done:      int64 [1]  programs of this launch finished (zero between launches)
    err:       int64 [4]  error record (see ``signals.py``)
    record:    int64 [at + 4]  out: the error record at ``at``
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels import nvshmem_device as nv
from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.signals import WAIT_DATA, last_to_finish, signal_put, wait_ge

BLOCK_B = 32
BLOCK_D = 128
NUM_WARPS = 4
#: Rows of the ``out_free`` and ``ids_free`` tables with ``PUT_PATH``: the addresses
#: through the peer mapping, the PEs, the symmetric addresses.
PUT_ROWS = 3


@triton.jit
def _release(addrs_ptr, n, value, PUT_PATH: tl.constexpr):
    """Stores ``value`` at each of the ``n`` addresses in ``addrs``, with release
    semantics at system scope (with ``PUT_PATH``, sets it with a signal where the
    address is 0)."""
    for i in range(n):
        addr = tl.load(addrs_ptr + i)
        if PUT_PATH:
            if addr == 0:
                signal_put(
                    tl.load(addrs_ptr + 2 * n + i), value, nv.SIGNAL_SET, tl.load(addrs_ptr + n + i).to(tl.int32)
                )
            else:
                tl.atomic_xchg(addr.to(tl.pointer_type(tl.int64), bitcast=True), value, sem="release", scope="sys")
        else:
            word = addr.to(tl.pointer_type(tl.int64), bitcast=True)
            tl.atomic_xchg(word, value, sem="release", scope="sys")


@nv.has_put_path
@triton.jit(
    do_not_specialize=[
        "batch",
        "rows",
        "num_owners",
        "num_sources",
        "target",
        "out_step",
        "ids_step",
        "timeout_ns",
        "at",
    ]
)
def output_take_kernel(
    slot_ptr,
    out_ptr,
    counts_ptr,
    owners_ptr,
    out_free_ptr,
    ids_free_ptr,
    done_ptr,
    err_ptr,
    record_ptr,
    batch: tl.int64,
    rows: tl.int64,
    pitch,
    num_owners: tl.int64,
    num_sources: tl.int64,
    target: tl.int64,
    out_step: tl.int64,
    ids_step: tl.int64,
    timeout_ns: tl.int64,
    at: tl.int64,
    BLOCKS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PUT_PATH: tl.constexpr = False,
):
    blk = tl.program_id(0)
    c = tl.program_id(1)
    arrived = num_owners >= 0
    for i in range(num_owners):
        if arrived:
            arrived = tl.atomic_add(err_ptr, 0, sem="acquire", scope="gpu") == 0
        if arrived:
            owner = tl.load(owners_ptr + i)
            arrived = wait_ge(counts_ptr + owner, target, timeout_ns, err_ptr, owner, WAIT_DATA)
    # Every thread reads the slot after the one that waited (acquire) saw the counts.
    tl.debug_barrier()
    r = blk * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (r < batch)[:, None] & (cols < pitch)[None, :]
    at_rc = r.to(tl.int64)[:, None] * pitch + cols[None, :]
    acc = tl.load(slot_ptr + at_rc, mask=mask)
    for k in tl.static_range(1, BLOCKS):
        part = tl.load(slot_ptr + k * rows * pitch + at_rc, mask=mask)
        acc = (acc.to(tl.float32) + part.to(tl.float32)).to(acc.dtype)
    tl.store(out_ptr + at_rc, acc, mask=mask)
    # Every thread's reads of the slot are done before the tick.
    tl.debug_barrier()
    programs = tl.num_programs(0) * tl.num_programs(1)
    if last_to_finish(done_ptr, programs):
        words = tl.arange(0, 4)
        tl.store(record_ptr + at + words, tl.load(err_ptr + words))
        _release(out_free_ptr, num_owners, out_step, PUT_PATH)
        if ids_step > 0:
            _release(ids_free_ptr, num_sources, ids_step, PUT_PATH)


_launcher = Launcher(output_take_kernel)


def output_take(
    slot: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor,
    owners: torch.Tensor,
    out_free: torch.Tensor,
    ids_free: torch.Tensor,
    done: torch.Tensor,
    err: torch.Tensor,
    record: torch.Tensor,
    at: int,
    target: int,
    out_step: int,
    ids_step: int,
    timeout_ns: int,
    *,
    put_path: bool = False,
) -> None:
    """Launches ``(cdiv(batch, BLOCK_B), cdiv(pitch, BLOCK_D))`` programs, at least one,
    for ``out``'s ``batch`` rows (see the module docstring). With ``put_path``,
    ``out_free`` and ``ids_free`` are ``[PUT_ROWS, n]`` tables and free words without a
    peer mapping are set through NVSHMEM (which must be initialized)."""
    blocks, rows, pitch = slot.shape
    batch = out.size(0)
    grid = (max(cdiv(batch, BLOCK_B), 1), cdiv(pitch, BLOCK_D))
    num_sources = ids_free.size(-1)
    put = {}
    if put_path:
        nv.put_path_options("ids_free", ids_free, (PUT_ROWS, num_sources))
        put = nv.put_path_options("out_free", out_free, (PUT_ROWS, owners.numel()))
    _launcher[grid](
        slot,
        out,
        counts,
        owners,
        out_free,
        ids_free,
        done,
        err,
        record,
        batch,
        rows,
        pitch,
        owners.numel(),
        num_sources,
        target,
        out_step,
        ids_step,
        timeout_ns,
        at,
        BLOCKS=blocks,
        BLOCK_B=BLOCK_B,
        BLOCK_D=BLOCK_D,
        num_warps=NUM_WARPS,
        **put,
    )
