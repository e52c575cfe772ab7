"""Turns FBGEMM's ``transpose_embedding_input`` of one lookup group's ids (laid out by
``transpose_bags``) into what the update reads per sorted position (``row_update``,
``run_update``): its key, gradient row, scale and table, as ``sort_order`` writes them
after the other sort (the same arrays, in the same order: both sorts are stable over
the same keys in position order).

The op gives each sorted position its key (its row in the group's rows, or ``rows``
past the batch's ids: the extra feature's) and its bag's feature ``t`` and bag ``b``
packed in an int32 (``t << B_BITS | b``). So the reads here are sequential but for the
feature's few words, which stay in cache, and with ``SCALED`` (mean pooling) its bag's
two offsets; nothing is gathered through an order. Positions past the ids get the
update's sentinel and nothing else.

Program ``p`` takes sorted positions ``p * BLOCK ...``.

Buffers:
    keys:      int32 [N]  the op's sorted keys (its ``linear_indices_sorted``)
    infos:     int32 [N]  the op's sorted values (``infos_sorted``): feature and bag
    offsets:   int32 [bags + bags_per_feature + 1]  the offsets the op was given
               (``transpose_bags``; read with ``SCALED``)
    features:  int64 [F, FEATURE_WORDS]  per feature of the group: its table's first row
               in the group's rows, its column in the gradient, mean pooling (0/1)
               (``update_keys``)
    tables:    int64 [T, TABLE_WORDS]  per table of the group that has rows, by first
               row (``sort_order``)
    keys_out:  int32 [N]  out: the keys, the sentinel past the ids
    src_out:   int64 [N]  out: each sorted position's gradient row (element offset: bag
               times ``pitch`` plus the feature's column; not past the ids)
    scale_out: float32 [N]  out with ``SCALED``: 1 / its bag's length for a feature
               pooled by mean, else 1 (not past the ids)
    table_out: int32 [N]  out: each sorted position's table, its row of ``tables`` (not
               past the ids)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.sort_order import TABLE_WORDS, check_tables, table_of
from torchrec_pgas.kernels.update_keys import FEATURE_WORDS, sentinel

BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["n", "rows", "num_tables", "bags_per_feature", "pitch"])
def transposed_ids_kernel(
    keys_ptr,
    infos_ptr,
    offsets_ptr,
    features_ptr,
    tables_ptr,
    keys_out_ptr,
    src_out_ptr,
    scale_out_ptr,
    table_out_ptr,
    n: tl.int64,
    rows: tl.int64,
    num_tables: tl.int64,
    bags_per_feature: tl.int64,
    pitch: tl.int64,
    B_BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
    FEATURE_WORDS: tl.constexpr,
    TABLE_WORDS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    there = p < n
    key = tl.load(keys_ptr + p, mask=there, other=0).to(tl.int64)
    inside = there & (key != rows)
    info = tl.load(infos_ptr + p, mask=inside, other=0).to(tl.int64)
    t = info >> B_BITS
    b = info & ((1 << B_BITS) - 1)
    meta = features_ptr + t * FEATURE_WORDS
    tl.store(keys_out_ptr + p, tl.where(inside, key, SENTINEL).to(tl.int32), mask=there)
    tl.store(src_out_ptr + p, b * pitch + tl.load(meta + 1, mask=inside, other=0), mask=inside)
    if SCALED:
        mean = tl.load(meta + 2, mask=inside, other=0) != 0
        bag = t * bags_per_feature + b
        length = tl.load(offsets_ptr + bag + 1, mask=inside & mean, other=1) - tl.load(
            offsets_ptr + bag, mask=inside & mean, other=0
        )
        # As ``update_keys``: FBGEMM's IEEE division.
        one = tl.full([BLOCK], 1.0, tl.float32)
        scale = tl.where(mean, tl.math.div_rn(one, tl.maximum(length, 1).to(tl.float32)), 1.0)
        tl.store(scale_out_ptr + p, scale, mask=inside)
    tl.store(table_out_ptr + p, table_of(tables_ptr, key, inside, num_tables, TABLE_WORDS), mask=inside)


_launcher = Launcher(transposed_ids_kernel)


def transposed_ids(
    keys: torch.Tensor,
    infos: torch.Tensor,
    offsets: torch.Tensor,
    features: torch.Tensor,
    tables: torch.Tensor,
    keys_out: torch.Tensor,
    src_out: torch.Tensor,
    scale_out: torch.Tensor,
    table_out: torch.Tensor,
    rows: int,
    bags_per_feature: int,
    pitch: int,
    b_bits: int,
    scaled: bool,
) -> None:
    """Launches ``cdiv(N, BLOCK)`` programs (see the module docstring) for a group of
    ``rows`` rows whose bags the op's infos hold in their low ``b_bits`` bits."""
    n = keys.numel()
    if n == 0:
        return
    check_tables(tables)
    _launcher[(cdiv(n, BLOCK),)](
        keys,
        infos,
        offsets,
        features,
        tables,
        keys_out,
        src_out,
        scale_out,
        table_out,
        n,
        rows,
        tables.size(0),
        bags_per_feature,
        pitch,
        B_BITS=b_bits,
        SENTINEL=sentinel(torch.int32),
        FEATURE_WORDS=FEATURE_WORDS,
        TABLE_WORDS=TABLE_WORDS,
        SCALED=scaled,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
