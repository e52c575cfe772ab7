"""``pgas_table_wise``: TorchRec's table-wise sharding with one-sided input and output
distributions.

Tables are placed, stored, looked up and optimized exactly as TorchRec's
``table_wise`` does (``TwPooledEmbeddingSharding`` and its
``GroupedPooledEmbeddingsLookup``), so ``state_dict``, checkpoints and fused
optimizers behave identically. Only the two collectives are replaced: see
``tw_exchange`` for the algorithm.
"""

from typing import Any, Dict, List, Optional, TypeVar

import torch
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_lookup import (
    GroupedPooledEmbeddingsLookup,
    embeddings_cat_empty_rank_handle,
)
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.tw_base import TwFeature, attach_route, route_of
from torchrec_pgas.sharding.tw_exchange import TwExchange
from torchrec_pgas.transport import Transport, get_transport
from torchrec_pgas.types import PGAS_TABLE_WISE, PgasOptions

T = TypeVar("T")


class _Done(Awaitable[T]):
    """An awaitable whose value is already known."""

    def __init__(self, value: T) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> T:
        return self._value


class _ReceiveIds(Awaitable[KeyedJaggedTensor]):
    """Waits for every source's ids of the step and forms the lookup's KJT."""

    def __init__(self, exchange: Any) -> None:
        super().__init__()
        self._exchange = exchange

    def _wait_impl(self) -> KeyedJaggedTensor:
        return self._exchange.recv_ids()


class PgasTwSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Puts each owner's features into its per-source slot; no splits exchange."""

    def __init__(self, exchange: Any) -> None:
        super().__init__()
        self._exchange = exchange

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        self._exchange.send_ids(sparse_features)
        return _Done(_ReceiveIds(self._exchange))


class _ExchangePooled(torch.autograd.Function):
    """Forward puts pooled rows to their requesters; backward puts the gradient
    blocks back to their owners."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local_embs: torch.Tensor,
        anchor: torch.Tensor,
        exchange: Any,
        route: Any,
    ) -> torch.Tensor:
        ctx.exchange, ctx.route, ctx.shape = exchange, route, local_embs.shape
        return exchange.exchange_pooled(local_embs, route)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        grad = ctx.exchange.exchange_grads(grad_out, ctx.route, ctx.shape)
        if get_gradient_division():
            # TorchRec's all-to-all backward averages over ranks, the way DDP does for
            # dense parameters; match it so that training is identical.
            grad.div_(ctx.exchange.world_size)
        return grad, None, None, None


class PgasTwPooledEmbeddingDist(
    BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]
):
    """Puts pooled rows at their final place in each requester's output."""

    def __init__(self, exchange: Any) -> None:
        super().__init__()
        self._exchange = exchange

    def forward(
        self,
        local_embs: torch.Tensor,
        sharding_ctx: Optional[EmbeddingShardingContext] = None,
    ) -> Awaitable[torch.Tensor]:
        route = route_of(local_embs, PGAS_TABLE_WISE)
        if not torch.is_grad_enabled():
            return _Done(self._exchange.exchange_pooled(local_embs, route))
        # Every rank must run the backward exchange, also a rank whose own lookup
        # has nothing to differentiate (it owns no table): the anchor makes the
        # output require grad everywhere.
        anchor = torch.empty(0, requires_grad=True)
        return _Done(_ExchangePooled.apply(local_embs, anchor, self._exchange, route))


class PgasGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's table-wise lookup (same modules, parameters and state), which also
    takes the GPU exchange's fixed-shape ``LookupBatch`` of already-split groups."""

    def forward(self, sparse_features: Any) -> torch.Tensor:
        groups = getattr(sparse_features, "groups", None)
        if groups is None:
            out = super().forward(sparse_features)
        else:
            out = embeddings_cat_empty_rank_handle(
                self._forward(groups), self._dummy_embs_tensor, dim=1
            )
        return attach_route(out, route_of(sparse_features, PGAS_TABLE_WISE))


def _features_per_rank(sharding: TwPooledEmbeddingSharding) -> List[List[TwFeature]]:
    return [
        [
            TwFeature(name=f, table=table.name, num_embeddings=table.num_embeddings)
            for config in configs
            for table in config.embedding_tables
            for f in table.feature_names
        ]
        for configs in sharding._grouped_embedding_configs_per_rank
    ]


def _output_dtype(sharding_infos: List[EmbeddingShardingInfo]) -> torch.dtype:
    fused = sharding_infos[0].fused_params or {}
    output_dtype = fused.get("output_dtype")
    return output_dtype.as_dtype() if output_dtype is not None else torch.float32


class PgasTwPooledEmbeddingSharding(TwPooledEmbeddingSharding):
    """``pgas_table_wise`` sharding of an ``EmbeddingBagCollection``.

    Args:
        sharding_infos: the tables of this sharding type, as TorchRec passes them.
        env: the sharding environment (process group, rank, world size).
        device: where the lookup runs; CPU uses the host transport.
        options: run-time options (timeouts, capacity headroom, transport).
    """

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        options: Optional[PgasOptions] = None,
    ) -> None:
        super().__init__(sharding_infos, env, device)
        self._options = options or PgasOptions()
        self._out_dtype = _output_dtype(sharding_infos)
        self._exchange: Optional[TwExchange] = None

    def _get_exchange(self, device: Optional[torch.device]) -> Any:
        # Created on first use, collectively: every rank builds its dists in the
        # same order.
        if self._exchange is None:
            device = device or self._device or torch.device("cpu")
            assert self._pg is not None
            transport = get_transport(self._pg, device, self._options)
            args = dict(
                features_per_rank=_features_per_rank(self),
                dim_sum_per_rank=self._dim_sum_per_rank(),
                out_dtype=self._out_dtype,
                headroom=self._options.headroom,
                name=PGAS_TABLE_WISE,
            )
            self._exchange = (
                self._device_exchange(transport, args)
                if transport.device.type == "cuda"
                else TwExchange(transport=transport, **args)
            )
        return self._exchange

    def _device_exchange(self, transport: Transport, args: Dict[str, Any]) -> Any:
        from torchrec_pgas.sharding.tw_device_exchange import DeviceTwExchange

        configs = self._grouped_embedding_configs
        return DeviceTwExchange(
            transport=transport,  # type: ignore[arg-type]
            group_sizes=[c.num_features() for c in configs],
            weighted=any(c.is_weighted for c in configs),
            **args,
        )

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> PgasGroupedPooledEmbeddingsLookup:
        return PgasGroupedPooledEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            env=self._env,
        )

    def create_input_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return PgasTwSparseFeaturesDist(self._get_exchange(device))

    def create_output_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        return PgasTwPooledEmbeddingDist(self._get_exchange(device))
