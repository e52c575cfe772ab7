"""Buckets a source's ids by row block for ``pgas_row_wise``: owner ``o`` gets the ids of
its block of every table, local to the block, in their order in each bag.

This is FBGEMM's ``block_bucketize_sparse_features`` as TorchRec's ``row_wise`` calls
it (``bucketize_kjt_before_all2all``), ids past a table going to owner ``id mod W`` as
``id // W`` there, in two launches of one kernel and a cumulative sum: FBGEMM's
operator is a dozen host steps, and a step's time is the host's. Program ``p`` takes
bags ``p * BLOCK ...`` of the KJT (feature-major). With ``COUNT`` it writes each bag's
number of ids per owner; otherwise it puts each id at its place in its owner's bag.

Buffers:
    values:       int64 [n]          the KJT's ids (negative ids go to some owner too:
                                     the batch is refused, but routed in bounds)
    offsets:      int [F * B + 1]    the KJT's offsets (only ids in ``[0, n)`` are read,
                                     and only ``n`` are written, whatever the offsets)
    weights:      float32 [n]        per-sample weights (with HAS_WEIGHTS)
    block_sizes:  int64 [F]          rows of each feature's table per owner
    lengths_out:  int32 [W * F * B]  bag ``(o, f, b)`` at ``(o * F + f) * B + b`` (out
                                     with COUNT)
    offsets_out:  int [W * F * B + 1]  the running sum of ``lengths_out``
    values_out:   int64 [n]          out (without COUNT)
    weights_out:  float32 [n]        out (without COUNT, with HAS_WEIGHTS)
"""

from typing import Optional, Tuple

import fbgemm_gpu  # noqa: F401  (torch.ops.fbgemm)
import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv, next_power_of_2

BLOCK = 128
NUM_WARPS = 4


@triton.jit(do_not_specialize=["num_values", "num_bags", "batch", "world"])
def row_buckets_kernel(
    values_ptr,
    offsets_ptr,
    weights_ptr,
    block_sizes_ptr,
    lengths_out_ptr,
    offsets_out_ptr,
    values_out_ptr,
    weights_out_ptr,
    num_values: tl.int64,
    num_bags: tl.int64,
    batch: tl.int64,
    world: tl.int64,
    COUNT: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
    W_PAD: tl.constexpr,
):
    bag = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = bag < num_bags
    start = tl.load(offsets_ptr + bag, mask=in_range, other=0).to(tl.int64)
    L = tl.load(offsets_ptr + bag + 1, mask=in_range, other=0).to(tl.int64) - start
    rows = tl.load(block_sizes_ptr + bag // batch, mask=in_range, other=1)
    owners = tl.arange(0, W_PAD)
    out = owners[None, :].to(tl.int64) * num_bags + bag[:, None]
    out_ok = in_range[:, None] & (owners < world)[None, :]
    if COUNT:
        counts = tl.zeros([BLOCK, W_PAD], dtype=tl.int32)
    else:
        pos = tl.load(offsets_out_ptr + out, mask=out_ok, other=0).to(tl.int64)
    for j in range(0, tl.max(L)):
        # Offsets outside the ids (a torn KJT, negative lengths: the send refuses
        # them) read nothing, and bags they make overlap write nothing past the ids.
        take = (j < L) & (start + j >= 0) & (start + j < num_values)
        x = tl.load(values_ptr + start + j, mask=take, other=0)
        inside = (x >= 0) & (x < rows * world)
        o = tl.where(inside, x // rows, ((x % world) + world) % world)
        hit = (o[:, None] == owners[None, :]) & take[:, None]
        if COUNT:
            counts += hit.to(tl.int32)
        else:
            # Each id takes the next place of its owner's bag: ids keep their order.
            dst = tl.sum(tl.where(hit, pos, 0), axis=1)
            put = take & (dst < num_values)
            tl.store(values_out_ptr + dst, tl.where(inside, x - o * rows, x // world), mask=put)
            if HAS_WEIGHTS:
                tl.store(weights_out_ptr + dst, tl.load(weights_ptr + start + j, mask=take), mask=put)
            pos += hit.to(tl.int64)
    if COUNT:
        tl.store(lengths_out_ptr + out, counts, mask=out_ok)


_launcher = Launcher(row_buckets_kernel)


def row_buckets(
    values: torch.Tensor,
    offsets: torch.Tensor,
    weights: Optional[torch.Tensor],
    block_sizes: torch.Tensor,
    world: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The bucketed KJT's ``(values, offsets, lengths, weights)``, owner-major (see the
    module docstring)."""
    num_bags = offsets.numel() - 1
    lengths_out = torch.empty(world * num_bags, dtype=torch.int32, device=values.device)
    values_out = torch.empty_like(values)
    weights_out = torch.empty_like(weights) if weights is not None else None
    grid = (cdiv(num_bags, BLOCK),)
    args = (
        values,
        offsets,
        weights if weights is not None else values,
        block_sizes,
        lengths_out,
        lengths_out,
        values_out,
        weights_out if weights_out is not None else values_out,
        values.numel(),
        num_bags,
        num_bags // block_sizes.numel(),
        world,
    )
    meta = dict(HAS_WEIGHTS=weights is not None, BLOCK=BLOCK, W_PAD=next_power_of_2(world), num_warps=NUM_WARPS)
    if not num_bags:
        return values_out, offsets.new_zeros(1), lengths_out, weights_out
    _launcher[grid](*args, COUNT=True, **meta)
    offsets_out = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths_out)
    _launcher[grid](*args[:5], offsets_out, *args[6:], COUNT=False, **meta)
    return values_out, offsets_out, lengths_out, weights_out
