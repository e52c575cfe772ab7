"""The row-wise algorithm on a one-sided transport (host transport).

Every rank owns a block of rows of every table, the blocks TorchRec's ``row_wise``
uses (``ceil(rows / world)`` rows each). Forward, for a step:

1. ``send_ids``: the source checks its ids against the whole tables, buckets them by
   row block (FBGEMM's ``block_bucketize_sparse_features``, as TorchRec does), and puts
   each owner's bucket into that owner's per-source slot, with local row ids.
2. ``recv_ids``: as table-wise; the owner's lookup pools partial sums over its rows.
3. ``exchange_pooled``: the owner puts the partial sums of each source's samples into
   that source's slot *for this owner*; the requester adds the owners' partial sums
   in rank order, so the result does not depend on arrival order. Mean pooling is
   applied after the sum, as TorchRec's ``row_wise`` applies it (``mean_after_sum``).

Backward: every owner needs the whole output gradient of its samples (each owns part
of every bag), so the requester puts it into every owner's per-source slot.

``TwExchange`` runs all of it; ``RwExchange`` only gives it the row-wise strategies
(``RowBlockHostIds``, ``PartialSumOutput``, ``MeanAfterSum``).
"""

from typing import Sequence

import torch

from torchrec_pgas.kernels.ids_slot import Capacity
from torchrec_pgas.sharding.host_routing import PartialSumOutput, RowBlockHostIds
from torchrec_pgas.sharding.mean_after_sum import MeanAfterSum
from torchrec_pgas.sharding.tw_base import TwFeature
from torchrec_pgas.sharding.tw_exchange import TwExchange
from torchrec_pgas.transport import Transport


class RwExchange(TwExchange):
    """``TwExchange`` with ids routed by row block (``RowBlockHostIds``), every owner
    putting full-width partial sums into its own slot at the requester
    (``PartialSumOutput``), and mean pooling after their sum (``MeanAfterSum``).

    Args:
        transport: one-sided transport over the sharding's process group.
        features: the sharding's features with their tables' full row counts.
        local_rows: per rank, the rows of each feature's table that rank holds.
        dims: each feature's embedding dim, in order.
        mean: whether each feature's table pools by mean.
        out_dtype, capacity, name: as for ``BaseTwExchange``.
    """

    def __init__(
        self,
        transport: Transport,
        features: Sequence[TwFeature],
        local_rows: Sequence[Sequence[int]],
        dims: Sequence[int],
        mean: Sequence[bool],
        out_dtype: torch.dtype,
        capacity: Capacity,
        name: str,
        mean_by_count: bool = False,
    ) -> None:
        world, width = transport.world_size, sum(dims)
        block_sizes = torch.tensor([(f.num_embeddings + world - 1) // world for f in features], dtype=torch.int64)
        super().__init__(
            transport,
            routing=RowBlockHostIds(block_sizes, world),
            output=PartialSumOutput(world, width),
            features_per_rank=[
                [TwFeature(f.name, f.table, rows) for f, rows in zip(features, local_rows[r])] for r in range(world)
            ],
            dim_sum_per_rank=[width] * world,
            out_dtype=out_dtype,
            capacity=capacity,
            name=name,
            input_features=features,
            out_dim=width,  # every owner covers every column
            mean=MeanAfterSum(dims, mean, torch.device("cpu"), by_count=mean_by_count),
        )
