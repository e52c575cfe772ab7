"""The fused sparse update of one lookup group, first launch: the backward of the owner's
lookup and its optimizer step (``row_step``) for every row whose occurrences lie in one
block of sorted positions, as FBGEMM's fused backward does.

FBGEMM's backward cannot be captured with an index tensor of fixed capacity: it sorts
every entry of the tensor, and the entries past the batch's ids hold nothing. Here the
ids were keyed and sorted first (``update_keys``, then a stable sort, which puts every
row's occurrences together in batch order and the unused positions last), so the update
reads only the batch's ids and a captured step updates exactly the rows the batch read.

Program ``b`` takes the block of sorted positions ``b * BLOCK ...``, ``ROWS`` at once: it
loads all their gradient rows (each occurrence's bag's row of the gradient at its
feature's column, times its scale) together, so that no load waits on another
occurrence's, and sums each row's occurrences with a segmented scan over the positions
(in fp32; the run the previous tile ended in is carried into the next). At the last
position of each row in the block, it:

* applies the optimizer step to the row if all of the row's occurrences are in the
  block (most rows);
* else stores the block's sum in ``partial``: at ``2 * b`` if the row's run began in an
  earlier block, else at ``2 * b + 1``; ``run_update`` adds them up for the row's first
  block (with ``run_groups``' sums of the groups of blocks the run covers) and steps the
  row, so that a hot row's occurrences are summed by many programs.

Nothing is updated for a bad step: ``verdict`` (``step_verdict``) says so once for every
launch of the step, so that an error the transport records meanwhile cannot update part
of a step. A block of sentinel keys (past the batch's ids) ends at its first key: the
grid covers the index tensor's capacity, often twice the ids.

Buffers:
    keys:      int32 or int64 [N]  the sorted keys (``update_keys``)
    src:       int64 [N]  each sorted position's gradient row (``update_keys``, in the
               sort's order: the update reads no permutation, one dependent load less)
    scale:     float32 [N]  each sorted position's gradient scale (read with ``SCALED``)
    table_index: int32 [N]  each sorted position's table, its row of ``tables``
               (``sort_order``)
    tables:    int64 [T, TABLE_WORDS]  per table of the group that has rows: its first
               row, weights offset, dim and optimizer state offset (``sort_order``)
    grad:      [bags_per_feature, >= pitch] (fp32, fp16 or bf16)  the gradient of the
               owner's lookup output, each row's elements adjacent, rows ``stride``
               elements apart: ``pitch`` (the one ``src`` was computed at), or another
               (``RESTRIDE``: a column slice of a wider gradient); read 4 elements at a
               time where the stride and its address allow (``GRAD_ALIGNED``)
    weights:   float32 [...]  the group's weights (FBGEMM's ``weights_dev``), in/out
    state:     float32 [...]  the row-wise optimizer state (``momentum1_dev``), in/out
    partial:   float32 ``partial_shape(N, max_dim)``, rows of ``PARTIAL_PITCH``  out: the
               blocks' sums of rows that cross blocks
    verdict:   int64 [1]  nonzero for a bad step (``step_verdict``)
    hyper:     float32 [HYPER_WORDS]  the optimizer's learning rate, eps and weight
               decay (``row_step``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv, next_power_of_2, rows_adjacent
from torchrec_pgas.kernels.row_step import StepRule, hyper_parameters, row_step
from torchrec_pgas.kernels.sort_order import TABLE_WORDS, row_place
from torchrec_pgas.kernels.update_keys import sentinel

#: The elements of a program's tile (``ROWS`` positions of ``BLOCK_D``), at least
#: ``MIN_ROWS`` positions; sorted positions per block (``partial`` holds two rows per
#: block), at least a tile's.
TILE = 512
MIN_ROWS = 1
BLOCK = 64
NUM_WARPS = 1


def tile_rows(max_dim: int) -> int:
    """Sorted positions taken at once for rows of up to ``max_dim`` elements."""
    return max(MIN_ROWS, TILE // dim_block(max_dim))


def block_positions(max_dim: int) -> int:
    """Sorted positions per block for rows of up to ``max_dim`` elements."""
    return max(BLOCK, tile_rows(max_dim))


def partial_shape(n: int, max_dim: int) -> tuple:
    """``partial``'s shape for ``n`` sorted positions: two rows per block, of the group's
    widest dim rounded up to 16 elements (whole 64-byte lines)."""
    return 2 * cdiv(n, block_positions(max_dim)), cdiv(max_dim, 16) * 16


def dim_block(max_dim: int) -> int:
    return max(next_power_of_2(max_dim), 16)


@triton.jit
def block_edges(keys_ptr, b, n, BLOCK: tl.constexpr, SENTINEL: tl.constexpr):
    """Block ``b`` of the sorted keys: its positions ``[begin, end)``, its first key,
    whether that key's run began in an earlier block (``continued``), and the key after
    the block (``following``; the sentinel after the last): the runs whose sums in the
    block are partial ones."""
    begin = b * BLOCK
    end = tl.minimum(begin + BLOCK, n)
    first = tl.load(keys_ptr + begin)
    continued = (b > 0) & (tl.load(keys_ptr + begin - 1, mask=b > 0, other=SENTINEL) == first)
    following = tl.load(keys_ptr + end, mask=end < n, other=SENTINEL)
    return begin, end, first, continued, following


@triton.jit
def _run_sum(begins_a, sum_a, begins_b, sum_b):
    """Segmented sum: a span is the flag that a run begins in it, and the sum of its
    last run's part in it."""
    return begins_a | begins_b, tl.where(begins_b, sum_b, sum_a + sum_b)


@triton.jit(do_not_specialize=["n", "pitch", "stride", "weight_decay_mode"])
def row_update_kernel(
    keys_ptr,
    src_ptr,
    scale_ptr,
    table_index_ptr,
    tables_ptr,
    grad_ptr,
    weights_ptr,
    state_ptr,
    partial_ptr,
    verdict_ptr,
    n: tl.int64,
    pitch: tl.int64,
    stride: tl.int64,
    hyper_ptr,
    weight_decay_mode: tl.int64,
    OPTIM: tl.constexpr,
    SCALED: tl.constexpr,
    SENTINEL: tl.constexpr,
    TABLE_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTIAL_PITCH: tl.constexpr,
    GRAD_ALIGNED: tl.constexpr,
    RESTRIDE: tl.constexpr,
):
    good = tl.load(verdict_ptr) == 0
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    begin, end, first, continued, following = block_edges(keys_ptr, b, n, BLOCK, SENTINEL)
    # Blocks past the batch's ids (sentinel keys only: the sort put them last; the
    # capacity is often twice the ids) end here rather than read their positions.
    if good & (first != SENTINEL):
        learning_rate, eps, weight_decay = hyper_parameters(hyper_ptr)
        # The sum so far of the run the previous tile ended in.
        carry = tl.zeros([BLOCK_D], dtype=tl.float32)
        for t in range(BLOCK // ROWS):
            p = begin + t * ROWS + r
            in_block = p < end
            # Every position's key, gradient row and table at once (none of these loads
            # waits on another; past the batch's ids they are read, not used); the row's
            # place follows from its table's entry, which stays in cache.
            key = tl.load(keys_ptr + p, mask=in_block, other=SENTINEL)
            before = tl.load(keys_ptr + p - 1, mask=(p > begin) & in_block, other=SENTINEL)
            after = tl.load(keys_ptr + p + 1, mask=p + 1 < end, other=SENTINEL)
            src = tl.load(src_ptr + p, mask=in_block, other=0)
            if RESTRIDE:
                # ``src`` is a row and a column at ``pitch``: the same at the rows' stride.
                row = src // pitch
                src = row * stride + (src - row * pitch)
            if GRAD_ALIGNED:
                src = tl.multiple_of(src, 4)
            table = tl.load(table_index_ptr + p, mask=in_block, other=0)
            if SCALED:
                scale = tl.load(scale_ptr + p, mask=in_block, other=0.0)
            real = key != SENTINEL
            at, dim, state_at = row_place(tables_ptr, table, key, real, TABLE_WORDS)
            begins = real & (key != before)
            ends = real & (key != after)
            began_before = continued & (key == first)
            # Runs that end in the block at ``ends``: stepped here if they began in it too.
            whole = ends & ~began_before & (key != following)
            inside = real[:, None] & (d[None, :] < dim[:, None])
            # The gradient rows of all positions, and the weights of the rows stepped
            # here, in flight together.
            g = tl.load(grad_ptr + src[:, None] + d[None, :], mask=inside, other=0.0).to(tl.float32)
            w_ptr = weights_ptr + at[:, None] + d[None, :]
            w = tl.load(w_ptr, mask=whole[:, None] & inside, other=0.0)
            state = tl.zeros([ROWS], dtype=tl.float32)
            if OPTIM != 0:
                state = tl.load(state_ptr + state_at, mask=whole, other=0.0)
            if SCALED:
                g = g * tl.where(real, scale, 0.0)[:, None]
            g += tl.where(((r == 0) & real & ~begins)[:, None], carry[None, :], 0.0)
            # Each run's sum in the block so far, at its every position: in batch order, as
            # one warp's lane holds every position of the tile for its columns (positions
            # split over warps would be added in a fixed tree).
            _, s = tl.associative_scan((tl.broadcast_to(begins[:, None], (ROWS, BLOCK_D)), g), 0, _run_sum)
            carry = tl.sum(tl.where((r == ROWS - 1)[:, None], s, 0.0), axis=0)
            w, state = row_step(
                w,
                s,
                dim,
                state,
                learning_rate,
                eps,
                weight_decay,
                weight_decay_mode,
                OPTIM,
            )
            tl.store(w_ptr, w, mask=whole[:, None] & inside)
            if OPTIM != 0:
                tl.store(state_ptr + state_at, state, mask=whole)
            # A run that crosses the block's edges: the block's part of its sum.
            partial_at = 2 * b + (~began_before).to(tl.int64)
            crossing = ends & ~whole
            tl.store(partial_ptr + partial_at[:, None] * PARTIAL_PITCH + d[None, :], s, mask=crossing[:, None] & inside)


_launcher = Launcher(row_update_kernel)


def row_update(
    keys: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor,
    table_index: torch.Tensor,
    tables: torch.Tensor,
    grad: torch.Tensor,
    pitch: int,
    weights: torch.Tensor,
    state: torch.Tensor,
    partial: torch.Tensor,
    verdict: torch.Tensor,
    hyper: torch.Tensor,
    max_dim: int,
    rule: StepRule,
    scaled: bool,
) -> None:
    """Launches ``cdiv(N, block_positions(max_dim))`` programs (see the module docstring)
    for gradient rows at ``src``'s ``pitch``, which ``grad``'s rows may lie at another
    stride from."""
    n = keys.numel()
    if n == 0:
        return
    if not rows_adjacent(grad):
        raise ValueError(f"the gradient's rows must be contiguous, got strides {grad.stride()}")
    block = block_positions(max_dim)
    stride = grad.stride(0)
    _launcher[(cdiv(n, block),)](
        keys,
        src,
        scale,
        table_index,
        tables,
        grad,
        weights,
        state,
        partial,
        verdict,
        n,
        pitch,
        stride,
        hyper,
        rule.weight_decay_mode,
        OPTIM=rule.optim,
        SCALED=scaled,
        SENTINEL=sentinel(keys.dtype),
        TABLE_WORDS=TABLE_WORDS,
        BLOCK=block,
        ROWS=tile_rows(max_dim),
        BLOCK_D=dim_block(max_dim),
        PARTIAL_PITCH=partial.stride(0),
        GRAD_ALIGNED=stride % 4 == 0 and pitch % 4 == 0 and grad.data_ptr() % (4 * grad.element_size()) == 0,
        RESTRIDE=stride != pitch,
        num_warps=NUM_WARPS,
    )
