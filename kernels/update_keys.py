"""Keys one lookup group's ids by the table row they read: the first step of the fused
sparse update (a stable sort of the keys, then ``row_update`` and ``run_update``), which
sorts them so that every row's occurrences are adjacent, in batch order.

The index tensor has a fixed capacity (a captured step cannot size it by the batch):
positions past the last bag's end hold no id and get the sentinel, which sorts last.
Program ``p`` keys positions ``p * BLOCK ...``: each finds its bag by a binary search
of ``offsets`` (the last bag whose start is at or before it, so empty bags are skipped)
and the bag's feature, and writes, per position:

* its key, the row in the group's rows (FBGEMM's ``hash_size_cumsum`` of the feature's
  table plus the id: distinct for distinct rows, equal for features sharing a table);
  int32 where the group has fewer rows than the int32 sentinel, so that the sort has
  half the bits to pass over;
* where its gradient row starts in the lookup output's gradient (bag row times the
  gradient's pitch plus the feature's column), so that the update reads it with one
  load;
* with ``SCALED``, its gradient's scale: its per-sample weight (``WEIGHTED``), over its
  bag's length for mean pooling, else 1;
* where its row lies (``where``): its element offset in the weights, its dim and its
  index in the optimizer state, so that the update finds a row with one load.

It runs in the forward, right after the lookup, so that the keys are sorted while the
host runs the rest of the step; whether the step is bad is decided in the backward
(``step_verdict``).

Buffers:
    offsets:   int64 [bags + 1]  the group's bag offsets, feature-major, ``bags_per_feature``
               bags per feature
    indices:   int64 [N]  the group's ids (only ``[0, offsets[bags])`` are read)
    weights:   float32 [N]  per-sample weights (read with ``WEIGHTED``)
    features:  int64 [F, FEATURE_WORDS]  per feature of the group: its table's first row
               in the group's rows, its column in the gradient, mean pooling (0/1), its
               table's offset in the weights (elements), its dim, its table's offset in
               the optimizer state (rows)
    keys:      int32 or int64 [N]  out: each position's row key, or the sentinel
    src:       int64 [N]  out: each position's gradient row (element offset; undefined
               past the ids)
    scale:     float32 [N]  out with ``SCALED``: each position's gradient scale
    where:     int64 [N, WHERE_WORDS]  out: each position's row's weights offset, dim and
               optimizer state index (undefined past the ids)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv

BLOCK = 1024
NUM_WARPS = 4
#: ``features`` columns: the feature's table's first row in the group, its column in
#: the gradient, mean pooling (0/1), its table's offset in the weights, its dim, its
#: table's offset in the optimizer state.
FEATURE_WORDS = 6
ROW, COL, MEAN, WEIGHTS_AT, DIM, STATE_AT = range(FEATURE_WORDS)
#: ``where`` columns.
WHERE_WORDS = 3


def sentinel(dtype: torch.dtype) -> int:
    """The key of a position past the batch's ids (sorts after every row)."""
    return torch.iinfo(dtype).max


def key_dtype(total_rows: int) -> torch.dtype:
    """The narrowest key dtype whose sentinel lies past every row of the group."""
    return torch.int32 if total_rows < sentinel(torch.int32) else torch.int64


@triton.jit(do_not_specialize=["n", "bags", "bags_per_feature", "pitch", "search_steps"])
def update_keys_kernel(
    offsets_ptr,
    indices_ptr,
    weights_ptr,
    features_ptr,
    keys_ptr,
    src_ptr,
    scale_ptr,
    where_ptr,
    n: tl.int64,
    bags: tl.int64,
    bags_per_feature: tl.int64,
    pitch: tl.int64,
    search_steps: tl.int64,
    SENTINEL: tl.constexpr,
    FEATURE_WORDS: tl.constexpr,
    WHERE_WORDS: tl.constexpr,
    SCALED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = p < n
    total = tl.load(offsets_ptr + bags)
    valid = inside & (p < total)
    # The last bag b in [0, bags) with offsets[b] <= p.
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + bags - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        up = tl.load(offsets_ptr + mid, mask=valid, other=0) <= p
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    f = lo // bags_per_feature
    first_row = tl.load(features_ptr + f * FEATURE_WORDS, mask=valid, other=0)
    col = tl.load(features_ptr + f * FEATURE_WORDS + 1, mask=valid, other=0)
    ids = tl.load(indices_ptr + p, mask=valid, other=0)
    tl.store(keys_ptr + p, tl.where(valid, first_row + ids, SENTINEL), mask=inside)
    tl.store(src_ptr + p, (lo - f * bags_per_feature) * pitch + col, mask=valid)
    dim = tl.load(features_ptr + f * FEATURE_WORDS + 4, mask=valid, other=0)
    weights_at = tl.load(features_ptr + f * FEATURE_WORDS + 3, mask=valid, other=0)
    state_at = tl.load(features_ptr + f * FEATURE_WORDS + 5, mask=valid, other=0)
    tl.store(where_ptr + p * WHERE_WORDS, weights_at + ids * dim, mask=valid)
    tl.store(where_ptr + p * WHERE_WORDS + 1, dim, mask=valid)
    tl.store(where_ptr + p * WHERE_WORDS + 2, state_at + ids, mask=valid)
    if SCALED:
        scale = tl.full([BLOCK], 1.0, tl.float32)
        if WEIGHTED:
            scale = tl.load(weights_ptr + p, mask=valid, other=0.0)
        mean = tl.load(features_ptr + f * FEATURE_WORDS + 2, mask=valid, other=0) != 0
        length = tl.load(offsets_ptr + lo + 1, mask=valid & mean, other=1) - tl.load(
            offsets_ptr + lo, mask=valid & mean, other=0
        )
        scale = tl.where(mean, scale * (1.0 / length.to(tl.float32)), scale)
        tl.store(scale_ptr + p, scale, mask=inside)


_launcher = Launcher(update_keys_kernel)


def update_keys(
    offsets: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    features: torch.Tensor,
    keys: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor,
    where: torch.Tensor,
    bags_per_feature: int,
    pitch: int,
    scaled: bool,
    weighted: bool,
) -> None:
    """Launches ``cdiv(N, BLOCK)`` programs (see the module docstring)."""
    n, bags = indices.numel(), offsets.numel() - 1
    if n == 0:
        return
    _launcher[(cdiv(n, BLOCK),)](
        offsets,
        indices,
        weights,
        features,
        keys,
        src,
        scale,
        where,
        n,
        bags,
        bags_per_feature,
        pitch,
        max(bags, 1).bit_length(),
        SENTINEL=sentinel(keys.dtype),
        FEATURE_WORDS=FEATURE_WORDS,
        WHERE_WORDS=WHERE_WORDS,
        SCALED=scaled,
        WEIGHTED=weighted,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
