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

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.row_buckets import row_buckets
from torchrec_pgas.sharding.rw_exchange import MeanAfterSum
from torchrec_pgas.sharding.tw_base import TwFeature, route_of
from torchrec_pgas.sharding.tw_device_exchange import DeviceTwExchange, LookupBatch
from torchrec_pgas.transport.nvshmem import NvshmemTransport


class DeviceRwExchange(MeanAfterSum, DeviceTwExchange):
    """GPU counterpart of ``RwExchange`` (arguments: its own, plus the lookup's
    ``group_sizes``, ``weighted``, ``lookup_reads_only_bags`` and ``fused_lookup`` as
    for ``DeviceTwExchange``)."""

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
        super().__init__(
            transport,
            features_per_rank=[
                [TwFeature(f.name, f.table, rows) for f, rows in zip(features, local_rows[r])]
                for r in range(world)
            ],
            dim_sum_per_rank=[sum(dims)] * world,
            input_features=features,
            **kwargs,
        )
        # Every owner covers every column, into its own block of the output slot.
        self._dim_total = sum(dims)
        self._col_offsets = [0] * world
        self._out_blocks, self._my_out_block = world, self._me
        self._block_sizes = torch.tensor(
            [(f.num_embeddings + world - 1) // world for f in features], dtype=torch.int64, device=self._dev
        )
        self._init_mean(dims, mean, self._dev)

    def _route(
        self, kjt: KeyedJaggedTensor, values: torch.Tensor, offsets: torch.Tensor,
        lengths: torch.Tensor, weights: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Bucketed by row block: owner ``r`` gets keys ``r * F ... (r + 1) * F - 1``
        with ids local to its block. Bad ids land in some bucket (FBGEMM hashes ids
        past the blocks), but such a batch is sent as its header alone."""
        if kjt.stride() == 0:  # nothing to bucket
            return values, offsets, lengths, weights
        return row_buckets(values, offsets, weights, self._block_sizes, self._t.world_size)

    def _routed_features(self, owner: int) -> List[int]:
        """Owner ``owner``'s bucket: features ``owner * F ... (owner + 1) * F - 1``."""
        count = len(self._input_features)
        return list(range(owner * count, (owner + 1) * count))

    def recv_ids(self, step: int) -> LookupBatch:
        batch = super().recv_ids(step)
        route_of(batch, self._name).divisor = self._divisors.popleft()
        return batch

    def _unrouted(self, offsets: torch.Tensor, lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """As if every id went to owner 0: in range of the routed layout, and the first
        batch sizes the slots by all its ids."""
        rest = (self._t.world_size - 1) * lengths.numel()
        return (
            torch.cat([offsets, offsets[-1:].expand(rest)]),
            torch.cat([lengths, lengths.new_zeros(rest)]),
        )
