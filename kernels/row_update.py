"""The fused sparse update of one lookup group, first launch: the backward of the owner's
lookup and its optimizer step (``row_step``) for every row whose occurrences lie in one
block of sorted positions, as FBGEMM's fused backward does.

FBGEMM's backward cannot be captured with an index tensor of fixed capacity: it sorts
every entry of the tensor, and the entries past the batch's ids hold nothing. Here the
ids were keyed and sorted first (``update_keys``, then a stable sort, which puts every
row's occurrences together in batch order and the unused positions last), so the update
reads only the batch's ids and a captured step updates exactly the rows the batch read.

Program ``b`` takes sorted positions ``b * ROWS ...`` at once (rows in parallel: the
update is bound by the latency of its scattered reads); the first occurrence of each row
in the block sums the row's occurrences in the block (each occurrence's bag's row of the
gradient at its feature's column, times its scale; in fp32, in batch order) and:

* applies the optimizer step to the row if all of the row's occurrences are in the
  block (most rows: the update is bound by the latency of its scattered reads, so rows
  are taken many at a time);
* else stores the block's sum in ``partial``: at ``2 * b`` if the row's run began in an
  earlier block, else at ``2 * b + 1``; ``run_update`` adds them up for the row's first
  block and steps the row, so that a hot row's occurrences are summed by many programs.

Nothing is updated for a bad step (a source's header in ``record`` is not ``OK``, or
its error record holds an error): its outputs were NaN and the host raises for it; nor
once the transport's error record (``err``) holds one, such as the backward's wait for
the gradients that timed out.

Buffers:
    keys:      int32 or int64 [N]  the sorted keys (``update_keys``)
    src:       int64 [N]  each sorted position's gradient row (``update_keys``, in the
               sort's order: the update reads no permutation, one dependent load less)
    scale:     float32 [N]  each sorted position's gradient scale (read with ``SCALED``)
    where:     int64 [N, WHERE_WORDS]  each sorted position's row (``update_keys``)
    grad:      [bags_per_feature, pitch] (fp32, fp16 or bf16)  the gradient of the
               owner's lookup output (its rows read 4 elements at a time where ``pitch``
               and its address allow: ``GRAD_ALIGNED``)
    table:     float32 [...]  the group's weights (FBGEMM's ``weights_dev``), in/out
    state:     float32 [...]  the row-wise optimizer state (``momentum1_dev``), in/out
    partial:   float32 [2 * cdiv(N, ROWS), BLOCK_D]  out: the blocks' sums of rows that
               cross blocks
    record:    int64 [S * 8 + 4]  the step's headers, then its error record
    err:       int64 [4]  the transport's error record (see ``signals.py``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Status
from torchrec_pgas.kernels.launch import Launcher, cdiv, next_power_of_2
from torchrec_pgas.kernels.row_step import row_step
from torchrec_pgas.kernels.update_keys import WHERE_WORDS, sentinel

#: The elements of one program's tile (``ROWS`` positions of ``BLOCK_D``), at least
#: ``MIN_ROWS`` positions.
TILE = 1024
MIN_ROWS = 1
#: One warp per program: a block's rows in one warp take half the registers per row
#: of a block spread over warps, so that more rows are in flight.
NUM_WARPS = 1
_OK = Status.OK.value


def block_rows(max_dim: int) -> int:
    """Sorted positions per block for rows of up to ``max_dim`` elements."""
    return max(MIN_ROWS, TILE // dim_block(max_dim))


def dim_block(max_dim: int) -> int:
    return max(next_power_of_2(max_dim), 16)


@triton.jit
def step_is_bad(record_ptr, err_ptr, num_sources, HEADER_WORDS: tl.constexpr, OK: tl.constexpr):
    """Whether the step's record or the transport's error record holds an error (int32)."""
    bad = (tl.load(record_ptr + num_sources * HEADER_WORDS) != 0).to(tl.int32)
    bad |= (tl.load(err_ptr) != 0).to(tl.int32)
    for q in range(num_sources):
        bad |= (tl.load(record_ptr + q * HEADER_WORDS) != OK).to(tl.int32)
    return bad


@triton.jit(do_not_specialize=["n", "num_sources", "weight_decay_mode"])
def row_update_kernel(
    keys_ptr,
    src_ptr,
    scale_ptr,
    where_ptr,
    grad_ptr,
    table_ptr,
    state_ptr,
    partial_ptr,
    record_ptr,
    err_ptr,
    n: tl.int64,
    num_sources: tl.int64,
    learning_rate: tl.float32,
    eps: tl.float32,
    weight_decay: tl.float32,
    weight_decay_mode: tl.int64,
    OPTIM: tl.constexpr,
    SCALED: tl.constexpr,
    SENTINEL: tl.constexpr,
    WHERE_WORDS: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
    OK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GRAD_ALIGNED: tl.constexpr,
):
    bad = step_is_bad(record_ptr, err_ptr, num_sources, HEADER_WORDS, OK)
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    p = b * ROWS + r
    end = tl.minimum(b * ROWS + ROWS, n)
    key = tl.load(keys_ptr + p, mask=p < n, other=SENTINEL)
    before = tl.load(keys_ptr + p - 1, mask=(p > 0) & (p < n), other=SENTINEL)
    after = tl.load(keys_ptr + p + 1, mask=p + 1 < end, other=SENTINEL)
    # The block's first row began in an earlier block, its last goes on in the next:
    # their sums here are partial ones.
    first = tl.load(keys_ptr + b * ROWS)
    continued = (b > 0) & (tl.load(keys_ptr + b * ROWS - 1, mask=b > 0, other=SENTINEL) == first)
    following = tl.load(keys_ptr + end, mask=end < n, other=SENTINEL)
    began_before = continued & (key == first)
    start = (key != SENTINEL) & (bad == 0) & ((r == 0) | (key != before))
    whole = start & ~began_before & (key != following)

    # FBGEMM's rows are multiples of 4 elements: they move 4 at a time.
    at = tl.multiple_of(tl.load(where_ptr + p * WHERE_WORDS, mask=start, other=0), 4)
    dim = tl.multiple_of(tl.load(where_ptr + p * WHERE_WORDS + 1, mask=start, other=0), 4)
    state_at = tl.load(where_ptr + p * WHERE_WORDS + 2, mask=start, other=0)
    inside = start[:, None] & (d[None, :] < dim[:, None])
    w_ptr = table_ptr + at[:, None] + d[None, :]
    w = tl.load(w_ptr, mask=whole[:, None] & inside, other=0.0)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    j = p
    live = start
    while tl.max(live.to(tl.int32), axis=0) > 0:
        src = tl.load(src_ptr + j, mask=live, other=0)
        if GRAD_ALIGNED:
            src = tl.multiple_of(src, 4)
        g = tl.load(grad_ptr + src[:, None] + d[None, :], mask=live[:, None] & inside, other=0.0).to(tl.float32)
        if SCALED:
            g = g * tl.load(scale_ptr + j, mask=live, other=0.0)[:, None]
        acc += g
        # (The first occurrence's successor was read with the keys: most rows stop there.)
        j += 1
        second = (j == p + 1) & (after == key)
        later = tl.load(keys_ptr + j, mask=live & (j > p + 1) & (j < end), other=SENTINEL) == key
        live = live & (j < end) & (second | later)

    w = row_step(
        w,
        acc,
        dim,
        whole,
        state_ptr,
        state_at,
        learning_rate,
        eps,
        weight_decay,
        weight_decay_mode,
        OPTIM,
    )
    tl.store(w_ptr, w, mask=whole[:, None] & inside)
    partial_at = 2 * b + (~began_before).to(tl.int64)
    crossing = start & ~whole
    tl.store(partial_ptr + partial_at[:, None] * BLOCK_D + d[None, :], acc, mask=crossing[:, None] & inside)


_launcher = Launcher(row_update_kernel)


def row_update(
    keys: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor,
    where: torch.Tensor,
    grad: torch.Tensor,
    table: torch.Tensor,
    state: torch.Tensor,
    partial: torch.Tensor,
    record: torch.Tensor,
    err: torch.Tensor,
    num_sources: int,
    max_dim: int,
    optim: int,
    learning_rate: float,
    eps: float,
    weight_decay: float,
    weight_decay_mode: int,
    scaled: bool,
) -> None:
    """Launches ``cdiv(N, block_rows(max_dim))`` programs (see the module docstring)."""
    n = keys.numel()
    if n == 0:
        return
    rows = block_rows(max_dim)
    _launcher[(cdiv(n, rows),)](
        keys,
        src,
        scale,
        where,
        grad,
        table,
        state,
        partial,
        record,
        err,
        n,
        num_sources,
        learning_rate,
        eps,
        weight_decay,
        weight_decay_mode,
        OPTIM=optim,
        SCALED=scaled,
        SENTINEL=sentinel(keys.dtype),
        WHERE_WORDS=WHERE_WORDS,
        HEADER_WORDS=HEADER_WORDS,
        OK=_OK,
        ROWS=rows,
        BLOCK_D=dim_block(max_dim),
        GRAD_ALIGNED=grad.stride(0) % 4 == 0 and grad.data_ptr() % (4 * grad.element_size()) == 0,
        num_warps=NUM_WARPS,
    )
