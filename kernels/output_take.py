"""Takes a requester's output of one step out of its output slot: waits for every
owner's rows, copies the other owners' into the output (adding the owners' partial
sums in rank order, for row-wise), then hands the slot back to the owners, and the ids
slots back to their sources when the lookup pooled straight from them. One launch,
since a step's time is mostly the host's and each launch costs the host more than the
device.

The step is the clock's ``OUT + 1`` (``step_clock``; a replayed CUDA graph takes the
next one): it picks the generation of the output slots. Program ``(blk, c)`` waits
until every owner's counter for this rank has reached the clock's ``EXPECTED`` plus
``expect`` (not once the error record holds an error, such as another program's timed
out wait: the programs would otherwise time out wave after wave), then writes rows
``blk * BLOCK_B ...`` and columns ``c * BLOCK_D ...`` of ``out``: ``slot[0] + slot[1] +
...`` over the ``BLOCKS`` blocks, added in that order in fp32 and rounded to the output
dtype after each addition, as torch adds tensors. This rank's own rows are in ``out``
already (``lookup_put`` and ``rows_put`` store them there): block ``own_block``'s
columns ``4 * own_begin4 ... 4 * own_end4`` are read from ``out`` instead of the slot,
and with one block are neither read nor written again (at world size 1 nothing is
copied). If the step is bad (a source's header in ``record`` is not ``OK``, or the
error record holds an error), the rows are NaN instead: the host raises for the step
later (``ring``), and its output must not pass for a result meanwhile.

The programs tick ``done`` (acquire-release at GPU scope); the last one resets it,
copies the error record to ``record[at:]``, releases the slots (it stores the step into
every owner's free word for this rank, and with ``RELEASE_IDS`` the ids step of
``record`` into every source's, with release semantics at system scope: cumulative,
after every program's reads of the slot), advances the clock's ``OUT`` and
``EXPECTED`` words, and copies ``record`` into entry ``step % RING`` of ``ring``
(host memory), the step last, which the host reads without waiting for the device.

Compiled with ``PUT_PATH``, a free word whose address is 0 (a peer without a peer
mapping: another node) is set through NVSHMEM instead, with a signal (one per program:
``SIGNAL_SET`` of the same value), sent after the tick that orders every program's reads
before it. Without ``PUT_PATH`` the kernel is the same code as before the put path
existed.

Buffers:
    slots:     [DEPTH, BLOCKS, rows, pitch]  the output slots, per generation one block
               per owner that stores into it (table-wise: one block)
    out:       [batch, pitch], rows ``out_pitch`` apart  in/out: this rank's own rows in
               (see above), the output out (a column slice of the module's joined
               output, or contiguous)
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
    record:    int64 [at + 5]  the step's headers (``at = S * 8`` words, source-major),
               out: the error record at ``at``; the ids step at ``at + RECORD_STEP``
    clock:     int64 [WORDS]  in/out: the ``OUT`` and ``EXPECTED`` words
    ring:      int64 [RING, at + 6], host memory (pinned: an address the device
               reaches), given as an address: per entry a record, then its step
"""

from typing import Tuple

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels import nvshmem_device as nv
from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Status
from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.rows_put import check_own
from torchrec_pgas.kernels.signals import WAIT_DATA, last_to_finish, signal_put, wait_ge
from torchrec_pgas.kernels.step_clock import EXPECTED, OUT, RECORD_STEP

BLOCK_B = 32
BLOCK_D = 128
NUM_WARPS = 4
#: Rows of the ``out_free`` and ``ids_free`` tables with ``PUT_PATH``: the addresses
#: through the peer mapping, the PEs, the symmetric addresses.
PUT_ROWS = 3
#: Words of a step's record past its headers: the error record, then the ids step.
RECORD_WORDS = RECORD_STEP + 1
_OK = tl.constexpr(Status.OK.value)
_OUT = tl.constexpr(OUT)
_HEADER_WORDS = tl.constexpr(HEADER_WORDS)
_EXPECTED = tl.constexpr(EXPECTED)
_RECORD_STEP = tl.constexpr(RECORD_STEP)


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


@triton.jit
def _block(block_ptr, out_ptr, at_rc, at_out, mask, in_out, READ_OWN: tl.constexpr):
    """A block's tile: from ``out`` at ``at_out`` where ``in_out`` (this rank's own rows,
    stored there in place; undefined there unless ``READ_OWN``), else from the slot's
    block at ``block_ptr``, at ``at_rc``."""
    mine = tl.load(out_ptr + at_out, mask=mask & in_out & READ_OWN)
    theirs = tl.load(block_ptr + at_rc, mask=mask & ~in_out)
    return tl.where(in_out, mine, theirs)


@nv.has_put_path
@triton.jit(
    do_not_specialize=[
        "batch",
        "rows",
        "num_owners",
        "num_sources",
        "expect",
        "timeout_ns",
        "at",
        "ring_addr",
        "own_block",
        "own_begin4",
        "own_end4",
    ]
)
def output_take_kernel(
    slots_ptr,
    out_ptr,
    counts_ptr,
    owners_ptr,
    out_free_ptr,
    ids_free_ptr,
    done_ptr,
    err_ptr,
    record_ptr,
    clock_ptr,
    batch: tl.int64,
    rows: tl.int64,
    pitch,
    out_pitch,
    num_owners: tl.int64,
    num_sources: tl.int64,
    expect: tl.int64,
    timeout_ns: tl.int64,
    at: tl.int64,
    ring_addr: tl.int64,
    own_block: tl.int64,
    own_begin4: tl.int64,
    own_end4: tl.int64,
    DEPTH: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RELEASE_IDS: tl.constexpr,
    RING: tl.constexpr,
    PUT_PATH: tl.constexpr = False,
):
    blk = tl.program_id(0)
    c = tl.program_id(1)
    out_step = tl.load(clock_ptr + _OUT) + 1
    target = tl.load(clock_ptr + _EXPECTED) + expect
    slot_ptr = slots_ptr + (out_step % DEPTH) * BLOCKS * rows * pitch
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
    # A multiple of 4 elements (``check_own``), told so whatever its specialization.
    at_out = tl.multiple_of(r.to(tl.int64) * out_pitch, 4)[:, None] + cols[None, :]
    # Given in 4-element units (FBGEMM's dims are multiples of 4): the masks then keep
    # 4-element accesses.
    own_cols = ((cols >= own_begin4 * 4) & (cols < own_end4 * 4))[None, :]
    # With one block, this rank's own columns hold the output already: they are not
    # read (a bad step stores NaN there without them).
    acc = _block(slot_ptr, out_ptr, at_rc, at_out, mask, own_cols & (own_block == 0), BLOCKS > 1)
    for k in tl.static_range(1, BLOCKS):
        part = _block(slot_ptr + k * rows * pitch, out_ptr, at_rc, at_out, mask, own_cols & (own_block == k), True)
        acc = (acc.to(tl.float32) + part.to(tl.float32)).to(acc.dtype)
    bad = tl.atomic_add(err_ptr, 0, sem="acquire", scope="gpu") != 0
    for q in range(num_sources):
        bad |= tl.load(record_ptr + q * _HEADER_WORDS) != _OK
    acc = tl.where(bad, float("nan"), acc.to(tl.float32)).to(acc.dtype)
    unchanged = own_cols & (BLOCKS == 1)
    tl.store(out_ptr + at_out, acc, mask=mask & (bad | ~unchanged))
    # Every thread's reads of the slot are done before the tick.
    tl.debug_barrier()
    programs = tl.num_programs(0) * tl.num_programs(1)
    if last_to_finish(done_ptr, programs):
        words = tl.arange(0, 4)
        tl.store(record_ptr + at + words, tl.load(err_ptr + words))
        _release(out_free_ptr, num_owners, out_step, PUT_PATH)
        if RELEASE_IDS:
            _release(ids_free_ptr, num_sources, tl.load(record_ptr + at + _RECORD_STEP), PUT_PATH)
        tl.store(clock_ptr + _OUT, out_step)
        tl.store(clock_ptr + _EXPECTED, target)
        entry = ring_addr.to(tl.pointer_type(tl.int64), bitcast=True) + (out_step % RING) * (at + 6)
        for i in range(0, at + 5):
            tl.store(entry + i, tl.load(record_ptr + i))
        # The step last, released at system scope: the host reads it first.
        tl.atomic_xchg(entry + at + 5, out_step, sem="release", scope="sys")


_launcher = Launcher(output_take_kernel)


def output_take(
    slots: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor,
    owners: torch.Tensor,
    out_free: torch.Tensor,
    ids_free: torch.Tensor,
    done: torch.Tensor,
    err: torch.Tensor,
    record: torch.Tensor,
    at: int,
    clock: torch.Tensor,
    expect: int,
    release_ids: bool,
    ring: torch.Tensor,
    timeout_ns: int,
    own: Tuple[int, int, int],
    *,
    put_path: bool = False,
) -> None:
    """Launches ``(cdiv(batch, BLOCK_B), cdiv(pitch, BLOCK_D))`` programs, at least one,
    for ``out``'s ``batch`` rows (``rows_put.check_own``), once every owner has stored
    ``expect`` more programs (see the module docstring). ``own``: this rank's rows in ``out``, as its block and
    first and last-plus-one columns, multiples of 4 (an empty range if it owns no
    table). With ``put_path``, ``out_free`` and ``ids_free`` are ``[PUT_ROWS, n]`` tables and free
    words without a peer mapping are set through NVSHMEM (which must be initialized)."""
    depth, blocks, rows, pitch = slots.shape
    own_block, own_begin, own_end = own
    if own_begin % 4 or own_end % 4:
        raise ValueError(f"own: columns {own_begin}...{own_end} are not multiples of 4")
    if ring.dim() != 2 or ring.size(1) != at + RECORD_WORDS + 1 or ring.dtype != torch.int64:
        raise ValueError(f"ring: int64 [n, {at + RECORD_WORDS + 1}] expected, got {ring.dtype} {list(ring.shape)}")
    check_own(out, pitch, slots.dtype)
    batch = out.size(0)
    grid = (max(cdiv(batch, BLOCK_B), 1), cdiv(pitch, BLOCK_D))
    num_sources = ids_free.size(-1)
    put = {}
    if put_path:
        nv.put_path_options("ids_free", ids_free, (PUT_ROWS, num_sources))
        put = nv.put_path_options("out_free", out_free, (PUT_ROWS, owners.numel()))
    _launcher[grid](
        slots,
        out,
        counts,
        owners,
        out_free,
        ids_free,
        done,
        err,
        record,
        clock,
        batch,
        rows,
        pitch,
        out.stride(0),
        owners.numel(),
        num_sources,
        expect,
        timeout_ns,
        at,
        ring.data_ptr(),
        own_block,
        own_begin // 4,
        own_end // 4,
        DEPTH=depth,
        BLOCKS=blocks,
        BLOCK_B=BLOCK_B,
        BLOCK_D=BLOCK_D,
        RELEASE_IDS=release_ids,
        RING=ring.size(0),
        num_warps=NUM_WARPS,
        **put,
    )
