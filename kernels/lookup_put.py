"""Pools an owner's bags straight out of the ids slots and puts each pooled row at its
final place in the requester's output: the inference lookup, without an index tensor,
a lookup output or a separate put.

Program ``(blk, s, f)`` pools bags ``blk * BLOCK_B ...`` of feature ``f`` for requester
``s`` and stores them through ``s``'s peer mapping (NVLink) at the feature's columns;
this rank's own rows (``s == me``) go straight into its output tensor ``own``, rows
of the same pitch, which ``output_take`` then need not copy out of a slot.
The pooling is FBGEMM's, operation for operation, so results are bit-identical to
TorchRec's lookup: per bag, rows are added in id order into an fp32 accumulator
starting at zero (``fma(row, weight, acc)`` with per-sample weights), and the sum is
multiplied by ``1 / L`` (mean) or 1 (sum) before the cast to the output dtype.

A requester counts one arrival per block of ``COUNT_B`` rows of each owner, as for
``rows_put``: the programs of a block that holds rows tick ``done`` (acquire-release at
GPU scope: they all run on this GPU), and the last of them (``done`` reaches
``done_target``) resets it for the next launch and adds one to the requester's counter
with release semantics at system scope. Release is cumulative, so that count publishes
the rows every program of the block stored. Programs of blocks past the requester's
batch (half the grid with the default headroom) return once they read the batch size:
they store and tick nothing.

Compiled with ``PUT_PATH``, a requester without a peer mapping (its ``out_addrs`` entry
0: another node) is served through NVSHMEM, as in ``rows_put``: pooled rows go to a
local symmetric staging buffer laid out as its output slot, each program puts its rows
(``nvshmemx_putmem_nbi_block``) and completes them (``nvshmem_quiet``) before it ticks
``done``, so when the last program of a block adds the one to the requester's counter
(a signal) every row of the block has landed. Without ``PUT_PATH`` the kernel is the
same code as before the put path existed.

The steps are read from device memory (``step_clock``), so that a replayed CUDA graph
serves the step it replays: the ids step from the step's record (it picks the
generation of the ids slots) and the output step from the clock's ``OUT`` word plus
one (the generation of the requesters' output slots, and the flow control's wait).

Buffers:
    ids:       uint8 [DEPTH * S * slot_bytes], the ids mailbox: per generation, S slots
               of ``slot_bytes``, each an ``ids_slot`` layout (header: status, batch
               size, ...; ids int64 at ``ids_offset`` and weights float32 at
               ``weights_offset``, feature-major)
    ids_step:  int64 [1]  the ids step (in the step's record)
    out_step:  int64 [1]  the clock's ``OUT`` word: the output step is one more
    offsets:   int64 [F * S * batch_capacity + 1]  bag offsets of ``bag_offsets``: bag
               ``(f, s, b)`` is ``(f * S + s) * batch_capacity + b``
    features:  int64 [F, 4]  per feature: address of its table's row 0, dim, first
               column in the requester's output (both multiples of 4), 1 for mean
               pooling else 0
    table:     any tensor of the tables' dtype (only its pointer type is used); rows
               start at multiples of 4 elements (``ROW_ALIGN`` bytes)
    own:       [batch, pitch], rows ``own_pitch`` apart (the output's dtype)  this
               rank's output: requester ``me``'s rows go there instead of its slot (a
               column slice of the module's joined output, or contiguous)
    out_addrs: int64 [DEPTH, S]  per generation, the address of each requester's
               output slot (``OUT_ALIGN`` bytes aligned), rows of ``pitch`` elements (a
               multiple of 4), through the peer mapping; with ``PUT_PATH``, int64
               [DEPTH, PUT_ROWS, S], the tables of ``rows_put``: that row (0 where there is no
               mapping), then each requester's PE, the symmetric addresses of its
               output slot and of its counter word for this owner, and the address of
               a local symmetric staging buffer laid out as its output slot
    cnt_addrs: int64 [S]  address of each requester's counter word for this owner
               (unused for a requester served by puts)
    done:      int64 [S, cdiv(batch_capacity, COUNT_B)]  programs of this launch finished
               per block of ``COUNT_B`` rows (zero between launches)
    free:      int64 [S]  this rank's free signals: free[s] is the last step s released
    err:       int64 [4]  error record (see ``signals.py``)
"""

import torch
import triton
import triton.language as tl

# A requester counts blocks of ``rows_put``'s rows, whichever kernel put them.
from torchrec_pgas.kernels import nvshmem_device as nv
from torchrec_pgas.kernels.ids_slot import IdsSlotLayout
from torchrec_pgas.kernels.launch import Launcher, cdiv, next_power_of_2
from torchrec_pgas.kernels.rows_put import BLOCK_B as COUNT_B
from torchrec_pgas.kernels.rows_put import PUT_ROWS, check_own
from torchrec_pgas.kernels.signals import WAIT_OUT_FREE, count_in, last_to_finish, put_rows, signal_put, wait_ge

#: Bags per program, two per warp: fewer, wider programs keep more rows in flight per
#: multiprocessor (its count of resident programs is capped) and tick ``done`` less often.
BLOCK_B = 8
BLOCK_D = 128
NUM_WARPS = 4
#: Rows of a bag loaded at once: more rows in flight cost more in register pressure
#: than the extra loads gain (CHANGELOG.md has the measurements).
ROWS = 4
#: Earlier features whose ids a program counts at once, at most (to find its bags' ids).
MAX_FEATURES = 32
_PUT_ROWS = tl.constexpr(PUT_ROWS)


@triton.jit
def _row(table, ids_ptr, w_ptr, j, L, row_ok, dim, cols, col_ok, HAS_WEIGHTS: tl.constexpr):
    """Row ``j`` of every bag of the tile (zeros past a bag's end), its per-sample
    weight, and which bags have one."""
    take = row_ok & (j < L)
    idx = tl.load(ids_ptr + j, mask=take, other=0)
    # FBGEMM's dims are multiples of 4: rows start 4-element aligned (vector loads).
    row = tl.multiple_of(idx * dim, 4)
    vals = tl.load(table + row[:, None] + cols[None, :], mask=take[:, None] & col_ok[None, :], other=0.0)
    w = tl.load(w_ptr + j, mask=take, other=0.0) if HAS_WEIGHTS else 0.0
    return vals.to(tl.float32), w, take


@triton.jit
def _add(acc, vals, w, take, HAS_WEIGHTS: tl.constexpr):
    if HAS_WEIGHTS:
        step = tl.fma(vals, w[:, None], acc)
    else:
        step = acc + vals
    # Bags shorter than the row keep their sum as it is, bit for bit.
    return tl.where(take[:, None], step, acc)


@nv.has_put_path
@triton.jit(
    do_not_specialize=[
        "batch_capacity",
        "slot_bytes",
        "ids_offset",
        "weights_offset",
        "pitch",
        "own_pitch",
        "done_target",
        "timeout_ns",
        "me",
    ]
)
def lookup_put_kernel(
    mailbox_ptr,
    ids_step_ptr,
    out_step_ptr,
    offsets_ptr,
    features_ptr,
    table_ptr,
    own_ptr,
    out_addrs_ptr,
    cnt_addrs_ptr,
    done_ptr,
    free_ptr,
    err_ptr,
    batch_capacity: tl.int64,
    slot_bytes: tl.int64,
    ids_offset: tl.int64,
    weights_offset: tl.int64,
    pitch: tl.int64,
    own_pitch: tl.int64,
    done_target: tl.int64,
    timeout_ns: tl.int64,
    me: tl.int64,
    DEPTH: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
    COUNT_B: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    FEATURES: tl.constexpr,
    PUT_PATH: tl.constexpr = False,
):
    # Blocks of bags on the first axis: the others take at most 65535 programs.
    blk = tl.program_id(0)
    s = tl.program_id(1)
    f = tl.program_id(2)
    S = tl.num_programs(1)
    # For short bags a program's time is its chain of dependent loads: what does not
    # depend on the source's batch size is read alongside it. Bags past the batch are
    # empty (``bag_offsets``), so their lengths, not the batch size, mask the loads of
    # ids and rows, and only the stores wait for it.
    seg = (f * S + s).to(tl.int64) * batch_capacity
    rows = blk * BLOCK_B + tl.arange(0, BLOCK_B)
    in_capacity = rows < batch_capacity
    start = tl.load(offsets_ptr + seg + rows, mask=in_capacity, other=0)
    L = tl.load(offsets_ptr + seg + rows + 1, mask=in_capacity, other=0) - start
    meta = features_ptr + f * 4
    table = tl.multiple_of(tl.load(meta).to(table_ptr.dtype, bitcast=True), ROW_ALIGN)
    # Dims, columns and the pitch are multiples of 4 elements (FBGEMM's dims are):
    # told so, Triton loads and stores 4 elements at once (else one at a time).
    dim = tl.multiple_of(tl.load(meta + 1), 4)
    col = tl.multiple_of(tl.load(meta + 2), 4)
    mean = tl.load(meta + 3) != 0
    ids_step = tl.load(ids_step_ptr)
    out_step = tl.load(out_step_ptr) + 1
    slot = mailbox_ptr + (ids_step % DEPTH) * S * slot_bytes + s.to(tl.int64) * slot_bytes
    batch = tl.load(slot.to(tl.pointer_type(tl.int64), bitcast=True) + 1)
    # Blocks past the batch (half the grid with the default headroom) leave before the
    # loads of the earlier features' offsets: with short bags, programs that only
    # waited on those would otherwise hold a place on the multiprocessor as long as
    # those with rows.
    block = blk // (COUNT_B // BLOCK_B)
    if block * COUNT_B >= batch:
        return
    # Where feature f's ids start in the slot: after the earlier features' ids,
    # FEATURES of them read at once (one at a time, each waited on the last).
    first = seg - seg
    for g0 in range(0, f, FEATURES):
        g = g0 + tl.arange(0, FEATURES)
        g_bag = (g * S + s).to(tl.int64) * batch_capacity
        earlier = g < f
        ends = tl.load(offsets_ptr + g_bag + batch_capacity, mask=earlier, other=0)
        first += tl.sum(ends - tl.load(offsets_ptr + g_bag, mask=earlier, other=0))
    pos = first + start - tl.load(offsets_ptr + seg)
    ids_ptr = (slot + ids_offset).to(tl.pointer_type(tl.int64), bitcast=True) + pos
    w_ptr = (slot + weights_offset).to(tl.pointer_type(tl.float32), bitcast=True) + pos
    # This step's table of the requesters' output slots.
    if PUT_PATH:
        out_addrs_ptr += (out_step % DEPTH) * _PUT_ROWS * S
    else:
        out_addrs_ptr += (out_step % DEPTH) * S
    out_addr = tl.load(out_addrs_ptr + s)
    ok = blk * BLOCK_B < batch
    # This rank's own rows go to its output, not to a slot it must wait for (decided
    # without the batch size: its loads then need not wait for it).
    if s != me:
        free_target = out_step - DEPTH
        if ok & (free_target > 0):
            ok = wait_ge(free_ptr + s, free_target, timeout_ns, err_ptr, s, WAIT_OUT_FREE)
    # FBGEMM multiplies by 1/L (IEEE division) for mean and by 1 for sum.
    inv_L = tl.where(mean & (L != 0), tl.math.div_rn(tl.full([BLOCK_B], 1.0, tl.float32), L.to(tl.float32)), 1.0)
    if PUT_PATH:
        staged = out_addr == 0
        out_addr = tl.where(staged, tl.load(out_addrs_ptr + 4 * S + s), out_addr)
    out = tl.multiple_of(tl.where(s == me, own_ptr, out_addr.to(own_ptr.dtype, bitcast=True)), OUT_ALIGN)
    dst_rows = tl.multiple_of(rows.to(tl.int64) * tl.where(s == me, own_pitch, pitch) + col, 4)
    store_ok = (rows < batch) & ok
    longest = tl.max(L)
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
        # ROWS rows in flight per bag (their loads do not wait on the sum), added in id
        # order.
        for j in range(0, longest, ROWS):
            for u in tl.static_range(ROWS):
                v, w, t = _row(table, ids_ptr, w_ptr, j + u, L, in_capacity, dim, cols, col_ok, HAS_WEIGHTS)
                acc = _add(acc, v, w, t, HAS_WEIGHTS)
        acc = acc * inv_L[:, None]
        tl.store(
            out + dst_rows[:, None] + cols[None, :],
            acc.to(own_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
            mask=store_ok[:, None] & col_ok[None, :],
        )
    if PUT_PATH:
        if ok & staged:
            # Every thread's stores are issued before the block puts them.
            tl.debug_barrier()
            pe = tl.load(out_addrs_ptr + S + s).to(tl.int32)
            size = own_ptr.dtype.element_ty.primitive_bitwidth // 8
            at = col.to(tl.int64) * size
            dst = tl.load(out_addrs_ptr + 2 * S + s) + at
            n = tl.minimum(batch - blk * BLOCK_B, BLOCK_B)
            put_rows(dst, out_addr + at, pitch * size, dim.to(tl.int64) * size, blk * BLOCK_B, n, pe)
            # Landed before the tick: the count below publishes every program's rows.
            nv.quiet()
    # Every thread's stores are issued before the tick.
    tl.debug_barrier()
    cell = done_ptr + s * tl.cdiv(batch_capacity, COUNT_B) + block
    if last_to_finish(cell, done_target):
        # Not after a program of the block timed out: the requester must time out too
        # rather than read rows that were never stored.
        if tl.atomic_add(err_ptr, 0, sem="acquire", scope="gpu") == 0:
            if PUT_PATH:
                if tl.load(out_addrs_ptr + s) == 0:
                    pe = tl.load(out_addrs_ptr + S + s).to(tl.int32)
                    signal_put(tl.load(out_addrs_ptr + 3 * S + s), 1, nv.SIGNAL_ADD, pe)
                else:
                    count_in(cnt_addrs_ptr, s)
            else:
                count_in(cnt_addrs_ptr, s)


_launcher = Launcher(lookup_put_kernel)


def lookup_put(
    ids: torch.Tensor,
    ids_step: torch.Tensor,
    clock_out: torch.Tensor,
    offsets: torch.Tensor,
    features: torch.Tensor,
    table: torch.Tensor,
    own: torch.Tensor,
    me: int,
    out_addrs: torch.Tensor,
    cnt_addrs: torch.Tensor,
    done: torch.Tensor,
    free: torch.Tensor,
    err: torch.Tensor,
    layout: IdsSlotLayout,
    pitch: int,
    has_weights: bool,
    timeout_ns: int,
    *,
    put_path: bool = False,
) -> None:
    """Launches ``(cdiv(batch_capacity, COUNT_B) * COUNT_B / BLOCK_B, S, F)`` programs (see the module
    docstring) for the ids step in ``ids_step[0]`` (the step's record's word, which
    ``bag_offsets`` wrote) and the output step after ``clock_out[0]``. With ``put_path``,
    ``out_addrs`` is the ``[DEPTH, PUT_ROWS, S]`` table and requesters without a peer
    mapping are served through NVSHMEM (which must be initialized). ``own`` (this rank's
    output, rank ``me``'s batch rows of ``pitch``, ``rows_put.check_own``) takes ``me``'s
    rows; it gives the output's dtype."""
    depth, S, F = out_addrs.size(0), out_addrs.size(-1), features.size(0)
    if F == 0:
        return
    check_own(own, pitch, own.dtype)
    put = nv.put_path_options("out_addrs", out_addrs, (depth, PUT_ROWS, S)) if put_path else {}
    # Whole blocks of COUNT_B rows, so that every block has its full count of programs.
    grid = (cdiv(layout.batch_capacity, COUNT_B) * (COUNT_B // BLOCK_B), S, F)
    _launcher[grid](
        ids,
        ids_step,
        clock_out,
        offsets,
        features,
        table,
        own,
        out_addrs,
        cnt_addrs,
        done,
        free,
        err,
        layout.batch_capacity,
        layout.nbytes,
        layout.ids_offset,
        layout.weights_offset,
        pitch,
        own.stride(0),
        F * (COUNT_B // BLOCK_B),
        timeout_ns,
        me,
        DEPTH=depth,
        HAS_WEIGHTS=has_weights,
        ROW_ALIGN=4 * table.element_size(),
        OUT_ALIGN=4 * own.element_size(),
        COUNT_B=COUNT_B,
        BLOCK_B=BLOCK_B,
        BLOCK_D=BLOCK_D,
        ROWS=ROWS,
        FEATURES=min(next_power_of_2(F), MAX_FEATURES),
        num_warps=NUM_WARPS,
        **put,
    )


def done_counters(num_sources: int, layout: IdsSlotLayout, device: torch.device) -> torch.Tensor:
    """The zeroed ``done`` buffer for ``lookup_put`` (one word per block of rows)."""
    return torch.zeros(num_sources, cdiv(layout.batch_capacity, COUNT_B), dtype=torch.int64, device=device)
