"""Puts ``update_keys``' per-position arrays in the sort's order, so that the update
(``row_update``, ``run_update``) reads each sorted position's gradient row, scale and
row with no permutation: one pass over the sort's order for all of them, where an
indexing per array would read the order once per array. Positions past the batch's ids
(their key is the sentinel: the sort put them last) are left as they are: the update
reads nothing of them, and the index tensor's capacity is often twice the batch's ids.

Program ``p`` takes sorted positions ``p * BLOCK ...``.

Buffers:
    keys:      int32 or int64 [N]  the sorted keys (``update_keys``)
    order:     int64 [N]  the stable sort's permutation of the keys' positions
    src:       int64 [N]  each position's gradient row (``update_keys``)
    scale:     float32 [N]  each position's gradient scale (read with ``SCALED``)
    where:     int64 [N, WHERE_WORDS]  each position's row (``update_keys``)
    src_out:   int64 [N]  out: ``src[order]`` (not past the ids)
    scale_out: float32 [N]  out with ``SCALED``: ``scale[order]`` (not past the ids)
    where_out: int64 [N, WHERE_WORDS]  out: ``where[order]`` (not past the ids)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.update_keys import WHERE_WORDS, sentinel

BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["n"])
def sort_order_kernel(
    keys_ptr,
    order_ptr,
    src_ptr,
    scale_ptr,
    where_ptr,
    src_out_ptr,
    scale_out_ptr,
    where_out_ptr,
    n: tl.int64,
    SENTINEL: tl.constexpr,
    WHERE_WORDS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = p < n
    inside &= tl.load(keys_ptr + p, mask=inside, other=SENTINEL) != SENTINEL
    q = tl.load(order_ptr + p, mask=inside, other=0)
    tl.store(src_out_ptr + p, tl.load(src_ptr + q, mask=inside, other=0), mask=inside)
    for w in tl.static_range(WHERE_WORDS):
        word = tl.load(where_ptr + q * WHERE_WORDS + w, mask=inside, other=0)
        tl.store(where_out_ptr + p * WHERE_WORDS + w, word, mask=inside)
    if SCALED:
        tl.store(scale_out_ptr + p, tl.load(scale_ptr + q, mask=inside, other=0.0), mask=inside)


_launcher = Launcher(sort_order_kernel)


def sort_order(
    keys: torch.Tensor,
    order: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor,
    where: torch.Tensor,
    src_out: torch.Tensor,
    scale_out: torch.Tensor,
    where_out: torch.Tensor,
    scaled: bool,
) -> None:
    """Launches ``cdiv(N, BLOCK)`` programs (see the module docstring)."""
    n = order.numel()
    if n == 0:
        return
    _launcher[(cdiv(n, BLOCK),)](
        keys,
        order,
        src,
        scale,
        where,
        src_out,
        scale_out,
        where_out,
        n,
        SENTINEL=sentinel(keys.dtype),
        WHERE_WORDS=WHERE_WORDS,
        SCALED=scaled,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
