"""Puts ``update_keys``' per-position arrays in the sort's order, and writes which table
each sorted position's row lies in, so that the update (``row_update``, ``run_update``)
reads each sorted position's key, gradient row, scale and row with no permutation: one
pass over the sort's order, where an indexing per array would read the order once per
array. The sort gives only the order (``fused_update.sort_positions``: FBGEMM's radix
sort over the bits of the group's row count, with int32 positions), so the keys are put
in its order here too; positions past the batch's ids (their key is ``rows``: the sort put them last)
get the update's sentinel and nothing else: the update reads nothing more of them, and
the index tensor's capacity is often twice the batch's ids.

A row's place follows from its key (its row in the group's rows): the group's table
whose first row is the last at most the key (a binary search of the few tables, which
stay in cache), then the row's offset in that table (``row_place``). The search is done
here, once per position, and its result is one int32 per position: the update finds the
row's offset, dim and optimizer state from it and the key with one cached load, where
three int64 words per position written here and read there were two fifths of this
pass's traffic and the update's largest read after the gradient and the weights.

With ``PACKED`` (``update_keys.packs``), ``src`` holds each position's key beside its
gradient row, and one random access per position reads both (the keys are not read):
the ids are then the first ``offsets[bags] - offsets[0]`` sorted positions, since the
keys past them, ``rows``, are the largest.

Program ``p`` takes sorted positions ``p * BLOCK ...``.

Buffers:
    keys:      int32 or int64 [N]  the keys (``update_keys``), ``rows`` past the ids
               (not read with ``PACKED``)
    order:     int32 or int64 [N]  the stable sort's permutation of the keys' positions
    offsets:   int64 [bags + 1]  the group's bag offsets (read with ``PACKED``)
    src:       int64 [N]  each position's gradient row (``update_keys``); with
               ``PACKED``, times 2**32 plus its key
    scale:     float32 [N]  each position's gradient scale (read with ``SCALED``)
    tables:    int64 [T, TABLE_WORDS]  per table of the group that has rows, by first row:
               its first row in the group's rows, its offset in the weights (elements),
               its dim, its offset in the optimizer state (rows)
    src_out:   int64 [N]  out: ``src[order]`` (not past the ids)
    scale_out: float32 [N]  out with ``SCALED``: ``scale[order]`` (not past the ids)
    keys_out:  int32 or int64 [N]  out: ``keys[order]``, the sentinel past the ids
    table_out: int32 [N]  out: each sorted position's table, its row of ``tables`` (not
               past the ids)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.update_keys import sentinel

BLOCK = 1024
NUM_WARPS = 4
#: ``tables`` columns: a table's first row in the group's rows, its offset in the
#: weights (elements), its dim, its offset in the optimizer state (rows).
TABLE_WORDS = 4


@triton.jit
def row_place(tables_ptr, table, key, mask, TABLE_WORDS: tl.constexpr):
    """The row of key ``key`` in table ``table`` (its row of ``tables``): its offset in
    the weights and its dim (FBGEMM's rows are multiples of 4 elements: they move 4 at a
    time), and its index in the optimizer state."""
    meta = tables_ptr + table.to(tl.int64) * TABLE_WORDS
    row = key.to(tl.int64) - tl.load(meta, mask=mask, other=0)
    dim = tl.multiple_of(tl.load(meta + 2, mask=mask, other=0), 4)
    at = tl.multiple_of(tl.load(meta + 1, mask=mask, other=0) + row * dim, 4)
    state_at = tl.load(meta + 3, mask=mask, other=0) + row
    return at, dim, state_at


@triton.jit
def table_of(tables_ptr, key, mask, num_tables, TABLE_WORDS: tl.constexpr):
    """The table (its row of ``tables``, int32) holding each row key of ``key`` (int64):
    the last one whose first row is at most the key, by a binary search of the few
    tables (``t`` and the ``size`` tables from it hold it)."""
    t = key * 0
    size = num_tables
    while size > 1:
        half = size // 2
        up = tl.load(tables_ptr + (t + half) * TABLE_WORDS, mask=mask, other=0) <= key
        t = tl.where(up, t + half, t)
        size -= half
    return t.to(tl.int32)


@triton.jit(do_not_specialize=["n", "rows", "num_tables", "bags"])
def sort_order_kernel(
    keys_ptr,
    order_ptr,
    offsets_ptr,
    src_ptr,
    scale_ptr,
    tables_ptr,
    keys_out_ptr,
    src_out_ptr,
    scale_out_ptr,
    table_out_ptr,
    n: tl.int64,
    rows: tl.int64,
    num_tables: tl.int64,
    bags: tl.int64,
    SENTINEL: tl.constexpr,
    TABLE_WORDS: tl.constexpr,
    SCALED: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    there = p < n
    if PACKED:
        # Past the ids not even the order is read (half the capacity by default).
        inside = there & (p < tl.load(offsets_ptr + bags) - tl.load(offsets_ptr))
        q = tl.load(order_ptr + p, mask=inside, other=0)
        word = tl.load(src_ptr + q, mask=inside, other=0)
        key = word & 0xFFFFFFFF
        src = word >> 32
    else:
        q = tl.load(order_ptr + p, mask=there, other=0)
        key = tl.load(keys_ptr + q, mask=there, other=0).to(tl.int64)
        inside = there & (key != rows)
        src = tl.load(src_ptr + q, mask=inside, other=0)
    tl.store(keys_out_ptr + p, tl.where(inside, key, SENTINEL).to(keys_out_ptr.dtype.element_ty), mask=there)
    tl.store(src_out_ptr + p, src, mask=inside)
    if SCALED:
        tl.store(scale_out_ptr + p, tl.load(scale_ptr + q, mask=inside, other=0.0), mask=inside)
    tl.store(table_out_ptr + p, table_of(tables_ptr, key, inside, num_tables, TABLE_WORDS), mask=inside)


def check_tables(tables: torch.Tensor) -> None:
    """Raises unless ``tables`` is what ``table_of`` reads: [T >= 1, TABLE_WORDS]."""
    if tables.dim() != 2 or tables.size(0) == 0 or tables.size(1) != TABLE_WORDS:
        raise ValueError(f"tables must be [T >= 1, {TABLE_WORDS}], got {list(tables.shape)}")


_launcher = Launcher(sort_order_kernel)


def sort_order(
    keys: torch.Tensor,
    order: torch.Tensor,
    rows: int,
    offsets: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor,
    tables: torch.Tensor,
    keys_out: torch.Tensor,
    src_out: torch.Tensor,
    scale_out: torch.Tensor,
    table_out: torch.Tensor,
    scaled: bool,
    packed: bool,
) -> None:
    """Launches ``cdiv(N, BLOCK)`` programs (see the module docstring) for a group of
    ``rows`` rows; ``tables`` has at least one row; ``packed`` as ``update_keys`` was
    given it."""
    n = order.numel()
    if n == 0:
        return
    check_tables(tables)
    _launcher[(cdiv(n, BLOCK),)](
        keys,
        order,
        offsets,
        src,
        scale,
        tables,
        keys_out,
        src_out,
        scale_out,
        table_out,
        n,
        rows,
        tables.size(0),
        offsets.numel() - 1,
        SENTINEL=sentinel(keys_out.dtype),
        TABLE_WORDS=TABLE_WORDS,
        SCALED=scaled,
        PACKED=packed,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
