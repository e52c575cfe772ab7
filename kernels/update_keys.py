"""Keys one lookup group's ids by the table row they read: the first step of the fused
sparse update (a stable sort of the keys, then ``row_update`` and ``run_update``), which
sorts them so that every row's occurrences are adjacent, in batch order.

The index tensor has a fixed capacity (a captured step cannot size it by the batch):
positions past the last bag's end hold no id and get the key ``rows`` (the group's row
count), which sorts last and, as the largest key, bounds the bits the sort passes over
(``sort_order`` turns it into the update's sentinel).
The first ``cdiv(bags, BLOCK_B)`` programs take ``BLOCK_B`` bags each (a bag's feature,
column and mean pooling are the same for all its ids) and walk their ids ``BLOCK_J`` at
a time, so that no position searches for its bag (a bag of thousands of ids makes its
program loop that many times over ``BLOCK_J``); the other ``cdiv(N, BLOCK_B * BLOCK_J)``
programs put ``rows`` past the ids. The tile, ``TILE`` positions, is shaped by the
group's ids per bag (``tile_shape``): one-hot features fill it with many bags, long
bags with few, so that a program's fixed chain of dependent loads (offsets, feature,
ids) is paid for about a tile of positions either way. Per position, they write:

* its key, the row in the group's rows (FBGEMM's ``hash_size_cumsum`` of the feature's
  table plus the id: distinct for distinct rows, equal for features sharing a table);
  int32 where the group has fewer rows than the int32 sentinel, so that the sort moves
  half the bytes;
* where its gradient row starts in the lookup output's gradient (bag row times the
  gradient's pitch plus the feature's column), so that the update reads it with one
  load; with ``PACKED`` (``packs``: int32 keys and gradient rows below 2**31) that
  offset times 2**32 plus the key, so that ``sort_order`` gathers both with one random
  access instead of two;
* with ``SCALED``, its gradient's scale: its per-sample weight (``WEIGHTED``), over its
  bag's length for mean pooling, else 1.

Where a row lies in the weights and the optimizer state follows from its key alone:
``sort_order`` writes it after the sort, in the sort's order, rather than this kernel
before it (every position's three words would be gathered through the sort's order).

It runs in the forward, right after the lookup, so that the keys are sorted while the
host runs the rest of the step; whether the step is bad is decided in the backward
(``step_verdict``).

Buffers:
    offsets:   int64 [bags + 1]  the group's bag offsets, feature-major, ``bags_per_feature``
               bags per feature
    indices:   int64 or int32 [N]  the group's ids (only ``[0, offsets[bags])`` are read)
    weights:   float32 [N]  per-sample weights (read with ``WEIGHTED``)
    features:  int64 [F, FEATURE_WORDS]  per feature of the group: its table's first row
               in the group's rows, its column in the gradient, mean pooling (0/1)
    keys:      int32 or int64 [N]  out: each position's row key, or ``rows``
    src:       int64 [N]  out: each position's gradient row (element offset; with
               ``PACKED``, times 2**32 plus the key; undefined past the ids)
    scale:     float32 [N]  out with ``SCALED``: each position's gradient scale
"""

from typing import Tuple

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv, next_power_of_2

#: Positions of a program's tile (bags times ids of each bag taken at once), and the
#: fewest and most ids of each bag taken at once.
TILE = 512
MIN_J = 4
MAX_J = 32
#: Two positions per thread: the kernel is a chain of loads whose latency only other
#: programs hide, and more positions per thread cost registers, hence programs per
#: multiprocessor, faster than they save loads (CHANGELOG.md has the measurements).
NUM_WARPS = 8
#: ``features`` columns: the feature's table's first row in the group, its column in
#: the gradient, mean pooling (0/1).
FEATURE_WORDS = 3
ROW, COL, MEAN = range(FEATURE_WORDS)


def sentinel(dtype: torch.dtype) -> int:
    """The sorted key of a position past the batch's ids, as the update reads it (sorts
    after every row; ``sort_order`` writes it)."""
    return torch.iinfo(dtype).max


def tile_shape(ids: int, bags: int) -> Tuple[int, int]:
    """``(BLOCK_B, BLOCK_J)`` for ``ids`` positions over ``bags`` bags: ids of a bag taken
    at once as many as a bag holds on average (a power of two within ``MIN_J ...
    MAX_J``), and bags enough to fill the tile. ``ids`` is the index tensor's capacity,
    the owner's in each of its groups: with several groups, an estimate erring towards
    long bags, which costs a one-hot group programs but never a long bag's loop."""
    block_j = min(MAX_J, max(MIN_J, next_power_of_2(ids // max(bags, 1))))
    return max(1, TILE // block_j), block_j


def key_dtype(total_rows: int) -> torch.dtype:
    """The narrowest key dtype whose sentinel lies past every row of the group."""
    return torch.int32 if total_rows < sentinel(torch.int32) else torch.int64


def packs(keys: torch.dtype, bags_per_feature: int, pitch: int) -> bool:
    """Whether ``src`` can carry each position's key beside its gradient row (``PACKED``):
    int32 keys, and gradient rows of ``bags_per_feature`` bags of ``pitch`` elements
    whose offsets stay below 2**31."""
    return keys == torch.int32 and bags_per_feature * pitch < 2**31


@triton.jit(do_not_specialize=["n", "bags", "bags_per_feature", "pitch", "rows"])
def update_keys_kernel(
    offsets_ptr,
    indices_ptr,
    weights_ptr,
    features_ptr,
    keys_ptr,
    src_ptr,
    scale_ptr,
    n: tl.int64,
    bags: tl.int64,
    bags_per_feature: tl.int64,
    pitch: tl.int64,
    rows: tl.int64,
    FEATURE_WORDS: tl.constexpr,
    SCALED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    bag_programs = tl.cdiv(bags, BLOCK_B)
    if pid >= bag_programs:
        # ``rows`` past the batch's ids (and before the first bag, should it not start at 0).
        p = (pid - bag_programs) * (BLOCK_B * BLOCK_J) + tl.arange(0, BLOCK_B * BLOCK_J)
        past = (p < n) & ((p >= tl.load(offsets_ptr + bags)) | (p < tl.load(offsets_ptr)))
        tl.store(keys_ptr + p, (p * 0 + rows).to(keys_ptr.dtype.element_ty), mask=past)
        return
    b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = b < bags
    start = tl.load(offsets_ptr + b, mask=ok, other=0)
    length = tl.load(offsets_ptr + b + 1, mask=ok, other=0) - start
    meta = features_ptr + (b // bags_per_feature) * FEATURE_WORDS
    first_row = tl.load(meta, mask=ok, other=0)
    src = (b % bags_per_feature) * pitch + tl.load(meta + 1, mask=ok, other=0)
    if SCALED:
        mean = tl.load(meta + 2, mask=ok, other=0) != 0
        # FBGEMM's mean pooling scales each id's gradient by 1 / (the bag's length), an
        # IEEE division (Triton's ``/`` is an approximate one).
        one = tl.full([BLOCK_B], 1.0, tl.float32)
        bag_scale = tl.where(mean, tl.math.div_rn(one, tl.maximum(length, 1).to(tl.float32)), 1.0)
    j = tl.arange(0, BLOCK_J)
    for j0 in range(0, tl.max(length), BLOCK_J):
        p = start[:, None] + j0 + j[None, :]
        valid = ok[:, None] & (j0 + j[None, :] < length[:, None]) & (p < n)
        key = first_row[:, None] + tl.load(indices_ptr + p, mask=valid, other=0)
        tl.store(keys_ptr + p, key.to(keys_ptr.dtype.element_ty), mask=valid)
        word = src[:, None] + p * 0
        if PACKED:
            word = (word << 32) | key
        tl.store(src_ptr + p, word, mask=valid)
        if SCALED:
            scale = bag_scale[:, None] + tl.zeros([BLOCK_B, BLOCK_J], tl.float32)
            if WEIGHTED:
                scale = scale * tl.load(weights_ptr + p, mask=valid, other=0.0)
            tl.store(scale_ptr + p, scale, mask=valid)


_launcher = Launcher(update_keys_kernel)


def update_keys(
    offsets: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    features: torch.Tensor,
    keys: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor,
    bags_per_feature: int,
    pitch: int,
    rows: int,
    scaled: bool,
    weighted: bool,
    packed: bool,
) -> None:
    """Launches ``cdiv(bags, BLOCK_B) + cdiv(N, BLOCK_B * BLOCK_J)`` programs (see the
    module docstring) for a group of ``rows`` rows (``rows`` fits ``keys``' dtype);
    ``packed`` must be ``packs``' answer or False."""
    n, bags = indices.numel(), offsets.numel() - 1
    if n == 0:
        return
    if packed and not packs(keys.dtype, bags_per_feature, pitch):
        raise ValueError(f"{keys.dtype} keys and gradient rows of {bags_per_feature} x {pitch} do not pack")
    block_b, block_j = tile_shape(n, bags)
    _launcher[(cdiv(bags, block_b) + cdiv(n, block_b * block_j),)](
        offsets,
        indices,
        weights,
        features,
        keys,
        src,
        scale,
        n,
        bags,
        bags_per_feature,
        pitch,
        rows,
        FEATURE_WORDS=FEATURE_WORDS,
        SCALED=scaled,
        WEIGHTED=weighted,
        PACKED=packed,
        BLOCK_B=block_b,
        BLOCK_J=block_j,
        num_warps=NUM_WARPS,
    )
