"""Keys one lookup group's ids by the table row they read: the first step of the fused
sparse update (``row_update``), which sorts them so that every row's occurrences are
adjacent.

The index tensor has a fixed capacity (a captured step cannot size it by the batch):
positions past the last bag's end hold no id and get ``SENTINEL``, which sorts last.
Program ``p`` keys positions ``p * BLOCK ...``: each finds its bag by a binary search
of ``offsets`` (the last bag whose start is at or before it, so empty bags are skipped),
the bag's feature, and keys it by the element offset of its row in the group's weights
(``table offset + id * dim``: distinct for distinct rows, also of features that share a
table).

Buffers:
    offsets:   int64 [bags + 1]  the group's bag offsets, feature-major, ``bags_per_feature``
               bags per feature
    indices:   int64 [N]  the group's ids (only ``[0, offsets[bags])`` are read)
    features:  int64 [F, FEATURE_WORDS]  per feature of the group (``row_update``'s table):
               the element offset of its table in the weights, its dim, ...
    keys:      int64 [N]  out: each position's row key, or ``SENTINEL``
    bag_of:    int64 [N]  out: each position's bag (undefined past the ids)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv

BLOCK = 1024
NUM_WARPS = 4
#: The key of a position past the batch's ids (sorts after every row).
SENTINEL = torch.iinfo(torch.int64).max
#: ``features`` columns: table offset (elements), dim, column in the gradient, mean
#: pooling (0/1), table offset in the optimizer state (rows).
FEATURE_WORDS = 5
TABLE, DIM, COL, MEAN, STATE = range(FEATURE_WORDS)


@triton.jit(do_not_specialize=["n", "bags", "bags_per_feature", "search_steps"])
def update_keys_kernel(
    offsets_ptr,
    indices_ptr,
    features_ptr,
    keys_ptr,
    bag_of_ptr,
    n: tl.int64,
    bags: tl.int64,
    bags_per_feature: tl.int64,
    search_steps: tl.int64,
    SENTINEL: tl.constexpr,
    FEATURE_WORDS: tl.constexpr,
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
    table = tl.load(features_ptr + f * FEATURE_WORDS, mask=valid, other=0)
    dim = tl.load(features_ptr + f * FEATURE_WORDS + 1, mask=valid, other=0)
    ids = tl.load(indices_ptr + p, mask=valid, other=0)
    keys = tl.where(valid, table + ids * dim, SENTINEL)
    tl.store(keys_ptr + p, keys, mask=inside)
    tl.store(bag_of_ptr + p, lo, mask=inside)


_launcher = Launcher(update_keys_kernel)


def update_keys(
    offsets: torch.Tensor,
    indices: torch.Tensor,
    features: torch.Tensor,
    keys: torch.Tensor,
    bag_of: torch.Tensor,
    bags_per_feature: int,
) -> None:
    """Launches ``cdiv(N, BLOCK)`` programs (see the module docstring)."""
    n, bags = indices.numel(), offsets.numel() - 1
    if n == 0:
        return
    _launcher[(cdiv(n, BLOCK),)](
        offsets,
        indices,
        features,
        keys,
        bag_of,
        n,
        bags,
        bags_per_feature,
        max(bags, 1).bit_length(),
        SENTINEL=SENTINEL,
        FEATURE_WORDS=FEATURE_WORDS,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
