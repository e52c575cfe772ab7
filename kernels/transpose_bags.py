"""Lays one lookup group's ids of a step out for FBGEMM's ``transpose_embedding_input``,
the sort the update's keys take where the group's rows fit int32 and its ids are
unweighted (``fused_update.transpose_sort``).

That op keys each id of a bag by its row in the group's rows (``hash_size_cumsum`` of
the bag's feature plus the id) and sorts the keys with each id's bag and feature as its
value: the stable sort of the update's keys, in one op, with no permutation to gather
through afterwards. But it sorts the whole index tensor, and keys only the ids that lie
in a bag: the positions past the batch's ids (the index tensor has the slots' capacity)
would be sorted by whatever their memory held. So the layout here adds one feature past
the group's, whose first row is the group's row count (``rows``, which sorts last) and
whose bags cover those positions, each holding id 0 there: every position is keyed, the
batch's ids by their rows and the rest by ``rows``. The padding is spread over the
extra feature's ``bags_per_feature`` bags, since the op walks each bag's ids with one
warp.

Program ``p`` takes positions ``p * BLOCK ...`` of each of the three outputs' ranges
(the indices and offsets are int32: the op reads both in one dtype, and keys of the
indices' dtype, which in int32 halve the sort's traffic).

Buffers:
    offsets:     int64 [bags + 1]  the group's bag offsets, feature-major,
                 ``bags_per_feature`` bags per feature, from 0 (the index tensor starts
                 at the group's first bag)
    indices:     int32 [N]  the group's ids in ``[0, offsets[bags])``; out: 0 past them
    offsets_out: int32 [bags + bags_per_feature + 1]  out: the offsets, then the extra
                 feature's bags, which end at ``N``
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv

BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["n", "bags", "bags_per_feature"])
def transpose_bags_kernel(
    offsets_ptr,
    indices_ptr,
    offsets_out_ptr,
    n: tl.int64,
    bags: tl.int64,
    bags_per_feature: tl.int64,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    end = tl.load(offsets_ptr + bags)
    pad = n - end
    ok = p <= bags
    tl.store(offsets_out_ptr + p, tl.load(offsets_ptr + p, mask=ok, other=0).to(tl.int32), mask=ok)
    # The extra feature's bag b ends at ceil((b + 1) * pad / bags_per_feature) past the
    # ids: the last one at ``n``.
    extra = p < bags_per_feature
    ends = end + ((p + 1) * pad + bags_per_feature - 1) // bags_per_feature
    tl.store(offsets_out_ptr + bags + 1 + p, ends.to(tl.int32), mask=extra)
    tl.store(indices_ptr + end + p, (p * 0).to(tl.int32), mask=p < pad)


_launcher = Launcher(transpose_bags_kernel)


def transpose_bags(
    offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets_out: torch.Tensor,
    bags_per_feature: int,
) -> None:
    """Launches ``cdiv(max(bags + 1, bags_per_feature, N), BLOCK)`` programs (see the
    module docstring)."""
    n, bags = indices.numel(), offsets.numel() - 1
    if offsets_out.numel() != bags + bags_per_feature + 1:
        raise ValueError(
            f"offsets_out must hold {bags + bags_per_feature + 1} offsets (the group's "
            f"{bags} bags, {bags_per_feature} more and the end), got {offsets_out.numel()}"
        )
    _launcher[(cdiv(max(bags + 1, bags_per_feature, n), BLOCK),)](
        offsets,
        indices,
        offsets_out,
        n,
        bags,
        bags_per_feature,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
