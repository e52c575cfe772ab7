"""The fused sparse update of one lookup group: the backward of the owner's lookup and
its optimizer step in one launch, as FBGEMM's fused backward does, for ``EXACT_SGD``
and ``EXACT_ROWWISE_ADAGRAD`` with fp32 weights.

FBGEMM's backward cannot be captured with an index tensor of fixed capacity: it sorts
every entry of the tensor, and the entries past the batch's ids hold nothing. Here the
ids were keyed and sorted first (``update_keys``, then a stable sort, which puts every
row's occurrences together in batch order and the unused positions last), so the update
reads only the batch's ids and a captured step updates exactly the rows the batch read.

Program ``p`` takes sorted positions ``p * PER_PROGRAM ...`` at once (rows in parallel:
the update is bound by the latency of its scattered reads); each position that starts a
row's run sums the run's gradient rows (each occurrence's bag's row of
``grad`` at its feature's column, times its per-sample weight, over the bag's length
for mean pooling; in fp32, in batch order) and applies the optimizer to the row:

* ``SGD``: ``w -= lr * g``.
* ``ROWWISE_ADAGRAD``: as FBGEMM: ``m += mean((g + wd * w)^2)`` with L2 weight decay
  (mode 1), else ``mean(g^2)``; ``mult = lr / (sqrt(m) + eps)``; ``w = c * w - mult *
  g`` with ``c = 1 - mult * wd`` (L2), ``1 - lr * wd`` (decoupled, mode 2) or 1.

Nothing is updated for a bad step (a source's header in ``record`` is not ``OK``, or
its error record holds an error): its outputs were NaN and the host raises for it; nor
once the transport's error record (``err``) holds one, such as the backward's wait for
the gradients that timed out.

Buffers:
    keys:      int64 [N]  the sorted keys (``update_keys``)
    order:     int64 [N]  the sort's permutation: where each sorted key was
    bag_of:    int64 [N]  each (unsorted) position's bag
    offsets:   int64 [bags + 1]  the group's bag offsets
    weights:   float32 [N]  per-sample weights (read with ``WEIGHTED``)
    features:  int64 [F, FEATURE_WORDS]  see ``update_keys``
    grad:      [bags_per_feature, pitch] (fp32, fp16 or bf16)  the gradient of the
               owner's lookup output; feature f's bags at rows ``0 ...`` and columns
               ``features[f, COL] ...``
    table:     float32 [...]  the group's weights (FBGEMM's ``weights_dev``), in/out
    state:     float32 [...]  the row-wise optimizer state (``momentum1_dev``), in/out
    record:    int64 [S * 8 + 4]  the step's headers, then its error record
    err:       int64 [4]  the transport's error record (see ``signals.py``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Status
from torchrec_pgas.kernels.launch import Launcher, cdiv, next_power_of_2
from torchrec_pgas.kernels.update_keys import FEATURE_WORDS, SENTINEL

#: Sorted positions per program at most, and the elements of one program's tile.
PER_PROGRAM = 16
TILE = 2048
NUM_WARPS = 4
#: ``OPTIM`` values.
SGD, ROWWISE_ADAGRAD = 0, 1
_OK = Status.OK.value


@triton.jit(do_not_specialize=["n", "bags_per_feature", "pitch", "num_sources", "weight_decay_mode"])
def row_update_kernel(
    keys_ptr,
    order_ptr,
    bag_of_ptr,
    offsets_ptr,
    weights_ptr,
    features_ptr,
    grad_ptr,
    table_ptr,
    state_ptr,
    record_ptr,
    err_ptr,
    n: tl.int64,
    bags_per_feature: tl.int64,
    pitch: tl.int64,
    num_sources: tl.int64,
    learning_rate: tl.float32,
    eps: tl.float32,
    weight_decay: tl.float32,
    weight_decay_mode: tl.int64,
    OPTIM: tl.constexpr,
    WEIGHTED: tl.constexpr,
    SENTINEL: tl.constexpr,
    FEATURE_WORDS: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
    OK: tl.constexpr,
    PER_PROGRAM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # The forward's error record, and the transport's now (a backward wait that timed
    # out left the gradient slots stale).
    bad = (tl.load(record_ptr + num_sources * HEADER_WORDS) != 0).to(tl.int32)
    bad |= (tl.load(err_ptr) != 0).to(tl.int32)
    for q in range(num_sources):
        bad |= (tl.load(record_ptr + q * HEADER_WORDS) != OK).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    p = tl.program_id(0).to(tl.int64) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    key = tl.load(keys_ptr + p, mask=p < n, other=SENTINEL)
    before = tl.load(keys_ptr + p - 1, mask=(p > 0) & (p < n), other=SENTINEL)
    # The positions that start a row's run: each sums its run and updates the row.
    start = (p < n) & (key != SENTINEL) & (key != before) & (bad == 0)
    f0 = tl.load(bag_of_ptr + tl.load(order_ptr + p, mask=start, other=0), mask=start, other=0) // bags_per_feature
    dim = tl.load(features_ptr + f0 * FEATURE_WORDS + 1, mask=start, other=0)
    inside = start[:, None] & (d[None, :] < dim[:, None])
    acc = tl.zeros([PER_PROGRAM, BLOCK_D], dtype=tl.float32)
    j = p
    live = start
    while tl.max(live.to(tl.int32), axis=0) > 0:
        pos = tl.load(order_ptr + j, mask=live, other=0)
        bag = tl.load(bag_of_ptr + pos, mask=live, other=0)
        f = bag // bags_per_feature
        row = bag - f * bags_per_feature
        col = tl.load(features_ptr + f * FEATURE_WORDS + 2, mask=live, other=0)
        scale = tl.full([PER_PROGRAM], 1.0, tl.float32)
        if WEIGHTED:
            scale = tl.load(weights_ptr + pos, mask=live, other=0.0)
        mean = tl.load(features_ptr + f * FEATURE_WORDS + 3, mask=live, other=0) != 0
        length = tl.load(offsets_ptr + bag + 1, mask=live & mean, other=1) - tl.load(
            offsets_ptr + bag, mask=live & mean, other=0
        )
        scale = tl.where(mean, scale * (1.0 / length.to(tl.float32)), scale)
        m = live[:, None] & inside
        g = tl.load(grad_ptr + row[:, None] * pitch + col[:, None] + d[None, :], mask=m, other=0.0)
        acc += g.to(tl.float32) * scale[:, None]
        j += 1
        live = live & (tl.load(keys_ptr + j, mask=live & (j < n), other=SENTINEL) == key)
    w_ptr = table_ptr + key[:, None] + d[None, :]
    w = tl.load(w_ptr, mask=inside, other=0.0)
    if OPTIM == 0:
        w = w - learning_rate * acc
    else:
        g2 = acc
        if weight_decay_mode == 1:
            g2 = acc + weight_decay * w
        g_avg_square = tl.sum(g2 * g2, axis=1) / tl.maximum(dim, 1).to(tl.float32)
        table_at = tl.load(features_ptr + f0 * FEATURE_WORDS, mask=start, other=0)
        state_at = tl.load(features_ptr + f0 * FEATURE_WORDS + 4, mask=start, other=0)
        s_ptr = state_ptr + state_at + (key - table_at) // tl.maximum(dim, 1)
        sum_square = tl.load(s_ptr, mask=start, other=0.0) + g_avg_square
        tl.store(s_ptr, sum_square, mask=start)
        multiplier = learning_rate / (tl.sqrt_rn(sum_square) + eps)
        correction = tl.full([PER_PROGRAM], 1.0, tl.float32)
        if weight_decay_mode == 1:
            correction = 1.0 - multiplier * weight_decay
        elif weight_decay_mode == 2:
            correction = correction - learning_rate * weight_decay
        w = correction[:, None] * w - multiplier[:, None] * acc
    tl.store(w_ptr, w, mask=inside)


_launcher = Launcher(row_update_kernel)


def row_update(
    keys: torch.Tensor,
    order: torch.Tensor,
    bag_of: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor,
    features: torch.Tensor,
    grad: torch.Tensor,
    table: torch.Tensor,
    state: torch.Tensor,
    record: torch.Tensor,
    err: torch.Tensor,
    bags_per_feature: int,
    num_sources: int,
    max_dim: int,
    optim: int,
    learning_rate: float,
    eps: float,
    weight_decay: float,
    weight_decay_mode: int,
    weighted: bool,
) -> None:
    """Launches ``cdiv(N, rows)`` programs of ``rows`` sorted positions each, fewer
    than ``PER_PROGRAM`` for wide rows (a program's tile stays ``TILE`` elements)."""
    n = keys.numel()
    if n == 0:
        return
    block_d = max(next_power_of_2(max_dim), 16)
    rows = max(1, min(PER_PROGRAM, TILE // block_d))
    _launcher[(cdiv(n, rows),)](
        keys,
        order,
        bag_of,
        offsets,
        weights,
        features,
        grad,
        table,
        state,
        record,
        err,
        n,
        bags_per_feature,
        grad.stride(0),
        num_sources,
        learning_rate,
        eps,
        weight_decay,
        weight_decay_mode,
        OPTIM=optim,
        WEIGHTED=weighted,
        SENTINEL=SENTINEL,
        FEATURE_WORDS=FEATURE_WORDS,
        HEADER_WORDS=HEADER_WORDS,
        OK=_OK,
        PER_PROGRAM=rows,
        BLOCK_D=block_d,
        num_warps=NUM_WARPS,
    )
