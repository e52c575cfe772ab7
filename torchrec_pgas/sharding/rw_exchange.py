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
"""

from typing import List, Sequence

import torch
from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.mean_after_sum import MeanAfterSum
from torchrec_pgas.sharding.tw_base import TwFeature, with_float32_weights
from torchrec_pgas.sharding.tw_exchange import Route, TwExchange
from torchrec_pgas.transport import Transport


class RwExchange(TwExchange):
    """Moves one row-wise sharding's ids, partial sums and gradients.

    Args:
        transport: one-sided transport over the sharding's process group.
        features: the sharding's features with their tables' full row counts.
        local_rows: per rank, the rows of each feature's table that rank holds.
        dims: each feature's embedding dim, in order.
        mean: whether each feature's table pools by mean.
        out_dtype, headroom, name: as for ``TwExchange``.
    """

    _partial_sums = True

    def __init__(
        self,
        transport: Transport,
        features: Sequence[TwFeature],
        local_rows: Sequence[Sequence[int]],
        dims: Sequence[int],
        mean: Sequence[bool],
        out_dtype: torch.dtype,
        headroom: float,
        name: str,
    ) -> None:
        world = transport.world_size
        super().__init__(
            transport=transport,
            features_per_rank=[
                [TwFeature(f.name, f.table, rows) for f, rows in zip(features, local_rows[r])] for r in range(world)
            ],
            dim_sum_per_rank=[sum(dims)] * world,
            out_dtype=out_dtype,
            headroom=headroom,
            name=name,
            input_features=features,
            out_dim=sum(dims),  # every owner covers every column
            mean=MeanAfterSum(dims, mean, torch.device("cpu")),
        )
        self._block_sizes = torch.tensor([(f.num_embeddings + world - 1) // world for f in features], dtype=torch.int64)

    def _routable(self, pos: List[int]) -> bool:
        """Only the sharding's own order (``adopt_input_order``): the row blocks and
        the mean divisor are built per feature in that order."""
        return pos == list(range(len(pos)))

    def _by_owner(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Bucketed by row block: owner ``r`` gets keys ``r * F ... (r + 1) * F - 1``
        with ids local to its block."""
        bucketized, _ = bucketize_kjt_before_all2all(
            with_float32_weights(kjt), num_buckets=self._t.world_size, block_sizes=self._block_sizes
        )
        return bucketized

    def exchange_pooled(self, local_embs: torch.Tensor, route: Route) -> torch.Tensor:
        """Puts each requester's partial sums into its slot for this owner; returns
        this rank's sum over owners, in rank order."""
        box = self._out
        assert box is not None
        self._out_step += 1
        step = self._out_step
        me = self._t.rank
        for requester, block in enumerate(local_embs.detach().to(self._out_dtype).split(route.batch_sizes)):
            base = box.begin_send(requester, step)
            self._t.put(box.buffer, requester, base, block)
            box.end_send(requester, step)
        batch = route.batch_sizes[me]
        out = torch.zeros(batch, self._dim_total, dtype=self._out_dtype)
        for owner in range(self._t.world_size):
            box.wait(owner, step)
            out += (
                box.slot(owner, step)[: batch * self._dim_total * self._elem]
                .view(self._out_dtype)
                .view(batch, self._dim_total)
            )
            box.release(owner, step)
        return out

    def exchange_grads(
        self, grad_out: torch.Tensor, route: Route, local_embs_shape: torch.Size, divide: bool
    ) -> torch.Tensor:
        """Puts the whole gradient to every owner; returns the gradient of this owner's
        partial sums, rows in lookup order (divided by the world size if ``divide``)."""
        box = self._grads
        assert box is not None
        self._grad_step += 1
        step = self._grad_step
        grad = grad_out.to(self._out_dtype).contiguous()
        for owner in range(self._t.world_size):
            base = box.begin_send(owner, step)
            self._t.put(box.buffer, owner, base, grad)
            box.end_send(owner, step)
        blocks = []
        for source, batch in enumerate(route.batch_sizes):
            box.wait(source, step)
            nbytes = batch * self._dim_total * self._elem
            blocks.append(box.slot(source, step)[:nbytes].view(self._out_dtype).view(batch, self._dim_total).clone())
            box.release(source, step)
        return self._divided(torch.cat(blocks), divide)
