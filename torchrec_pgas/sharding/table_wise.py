"""``pgas_table_wise``: TorchRec's table-wise sharding with one-sided input and output
distributions.

Tables are placed, stored, looked up and optimized exactly as TorchRec's
``table_wise`` does (``TwPooledEmbeddingSharding`` and its
``GroupedPooledEmbeddingsLookup``), so ``state_dict``, checkpoints and fused
optimizers behave identically. Only the two collectives are replaced: see
``tw_exchange`` for the algorithm.
"""

from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.dists import (
    PgasGroupedPooledEmbeddingsLookup,
    PgasPooledEmbeddingDist,
    PgasSparseFeaturesDist,
)
from torchrec_pgas.sharding.tw_base import TwFeature
from torchrec_pgas.sharding.tw_exchange import TwExchange
from torchrec_pgas.transport import Transport, get_transport
from torchrec_pgas.types import PGAS_TABLE_WISE, PgasOptions


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


def output_dtype(sharding_infos: List[EmbeddingShardingInfo]) -> torch.dtype:
    """The pooled embeddings' dtype (TorchRec's ``output_dtype`` fused parameter)."""
    fused = sharding_infos[0].fused_params or {}
    dtype = fused.get("output_dtype")
    return dtype.as_dtype() if dtype is not None else torch.float32


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
        self._out_dtype = output_dtype(sharding_infos)
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
            name=PGAS_TABLE_WISE,
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            env=self._env,
        )

    def create_input_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return PgasSparseFeaturesDist(self._get_exchange(device))

    def create_output_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        return PgasPooledEmbeddingDist(self._get_exchange(device), PGAS_TABLE_WISE)
