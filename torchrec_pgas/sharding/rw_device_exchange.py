"""The row-wise algorithm on GPUs: ``tw_device_exchange``'s kernels on row blocks.

Every rank owns a block of rows of every table (TorchRec's ``row_wise`` blocks,
``ceil(rows / world)`` rows). What differs from table-wise:

* ``send_ids``: ids are checked against the whole tables, then bucketed by row block
  on the device (``kernels/row_buckets``: FBGEMM's ``block_bucketize_sparse_features``
  as TorchRec calls it, in fewer host steps), and
  owner ``o``'s bucket, with ids local to its block, goes into its slot. Nothing is
  read back: a bucket holds exactly the ids of its block, whatever their count.
* ``exchange_pooled``: every owner pools partial sums of every feature and stores
  them into its own block of the requester's output slot (``[world, rows, dims]``);
  the requester adds the blocks in rank order (deterministic), then divides mean
  pooled columns by the bag lengths it kept from its send.
* ``exchange_grads``: each owner needs the whole gradient of its sources' samples, so
  the requester puts all of ``grad_out`` into every owner's slot.
"""

from typing import Any, Sequence

import torch

from torchrec_pgas.sharding.device_batch import LookupBatch
from torchrec_pgas.sharding.device_routing import OutputBlocks, RowBlockIds
from torchrec_pgas.sharding.rw_exchange import MeanAfterSum
from torchrec_pgas.sharding.tw_base import TwFeature, route_of
from torchrec_pgas.sharding.tw_device_exchange import DeviceTwExchange
from torchrec_pgas.transport.nvshmem import NvshmemTransport


class DeviceRwExchange(MeanAfterSum, DeviceTwExchange):
    """GPU counterpart of ``RwExchange`` (arguments: its own, plus the lookup's
    ``group_sizes``, ``weighted``, ``lookup_reads_only_bags`` and ``fused_lookup`` as
    for ``DeviceTwExchange``): ``DeviceTwExchange`` with ids routed by row block
    (``RowBlockIds``) and every owner storing full-width partial sums into its own
    block of the output slot (``OutputBlocks``)."""

    def __init__(
        self,
        transport: NvshmemTransport,
        features: Sequence[TwFeature],
        local_rows: Sequence[Sequence[int]],
        dims: Sequence[int],
        mean: Sequence[bool],
        **kwargs: Any,
    ) -> None:
        world = transport.world_size
        block_sizes = torch.tensor(
            [(f.num_embeddings + world - 1) // world for f in features], dtype=torch.int64, device=transport.device
        )
        super().__init__(
            transport,
            features_per_rank=[
                [TwFeature(f.name, f.table, rows) for f, rows in zip(features, local_rows[r])]
                for r in range(world)
            ],
            dim_sum_per_rank=[sum(dims)] * world,
            input_features=features,
            routing=RowBlockIds(block_sizes, world),
            output=OutputBlocks(blocks=world, my_block=transport.rank, dim=sum(dims), col_offsets=(0,) * world),
            **kwargs,
        )
        # ``MeanAfterSum`` reads the output's width here; ``BaseTwExchange`` makes it
        # the sum over ranks of ``dim_sum_per_rank``, which row-wise repeats per rank.
        self._dim_total = sum(dims)
        self._init_mean(dims, mean, self._dev)

    def recv_ids(self, step: int) -> LookupBatch:
        batch = super().recv_ids(step)
        route_of(batch, self._name).divisor = self._divisors.popleft()
        return batch
