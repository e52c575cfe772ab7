"""The row-wise algorithm on GPUs: ``tw_device_exchange``'s kernels on row blocks.

Every rank owns a block of rows of every table (TorchRec's ``row_wise`` blocks,
``ceil(rows / world)`` rows). What differs from table-wise:

* ``send_ids``: ids are checked against the whole tables, then bucketed by row block
  on the device (``kernels/row_buckets``: FBGEMM's ``block_bucketize_sparse_features``
  as TorchRec calls it, in fewer host steps), and
  owner ``o``'s bucket, with ids local to its block, goes into its slot. Nothing is
  read back: a bucket holds exactly the ids of its block, whatever their count. A
  batch with other shardings' features (``adopt_input_order``) is bucketed whole, in
  its order; each owner's bucket of the sharding's features goes, as runs of them.
* ``exchange_pooled``: every owner pools partial sums of every feature and stores
  them into its own block of the requester's output slot (``[world, rows, dims]``);
  the requester adds the blocks in rank order (deterministic), then divides mean
  pooled columns by the bag lengths it kept from its send.
* ``exchange_grads``: each owner needs the whole gradient of its sources' samples, so
  the requester puts all of ``grad_out`` into every owner's slot.
"""

from typing import Any, Sequence

import torch

from torchrec_pgas.sharding.device_routing import OutputBlocks, RowBlockIds
from torchrec_pgas.sharding.mean_after_sum import MeanAfterSum
from torchrec_pgas.sharding.tw_base import TwFeature
from torchrec_pgas.sharding.tw_device_exchange import DeviceTwExchange
from torchrec_pgas.transport.nvshmem import NvshmemTransport


class DeviceRwExchange(DeviceTwExchange):
    """GPU counterpart of ``RwExchange`` (arguments: its own, plus the lookup's
    ``group_sizes``, ``weighted``, ``lookup_reads_only_bags`` and ``fused_lookup`` as
    for ``DeviceTwExchange``): ``DeviceTwExchange`` with ids routed by row block
    (``RowBlockIds``), every owner storing full-width partial sums into its own block
    of the output slot (``OutputBlocks``), and mean pooling after their sum
    (``MeanAfterSum``)."""

    def __init__(
        self,
        transport: NvshmemTransport,
        features: Sequence[TwFeature],
        local_rows: Sequence[Sequence[int]],
        dims: Sequence[int],
        mean: Sequence[bool],
        mean_by_count: bool = False,
        **kwargs: Any,
    ) -> None:
        world, width = transport.world_size, sum(dims)
        block_sizes = torch.tensor(
            [(f.num_embeddings + world - 1) // world for f in features], dtype=torch.int64, device=transport.device
        )
        routing = RowBlockIds(block_sizes, world)
        super().__init__(
            transport,
            features_per_rank=[
                [TwFeature(f.name, f.table, rows) for f, rows in zip(features, local_rows[r])] for r in range(world)
            ],
            dim_sum_per_rank=[width] * world,
            input_features=features,
            out_dim=width,  # every owner covers every column
            mean=MeanAfterSum(dims, mean, transport.device, by_count=mean_by_count),
            routing=routing,
            output=OutputBlocks(blocks=world, my_block=transport.rank, dim=width, col_offsets=(0,) * world),
            **kwargs,
        )
        self._row_blocks = routing

    def adopt_input_order(self, keys: Sequence[str], others: Sequence[TwFeature] = ()) -> bool:
        """See ``BaseTwExchange.adopt_input_order``; the row blocks then bucket every
        feature of such batches (``RowBlockIds.adopt_input_order``)."""
        if not super().adopt_input_order(keys, others):
            return False
        self._row_blocks.adopt_input_order(self._input_pos, len(keys))
        return True
