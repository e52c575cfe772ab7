"""``pgas_row_wise``: TorchRec's row-wise sharding with one-sided input and output
distributions.

Rows are placed, stored, looked up and optimized as TorchRec's ``row_wise`` does
(``RwPooledEmbeddingSharding``), so ``state_dict`` and checkpoints are interchangeable
with it; the bucketize + all-to-all and the reduce-scatter are replaced by the
exchange in ``rw_exchange``. Host transport only for now: on GPUs it raises.
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
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.dists import (
    PgasGroupedPooledEmbeddingsLookup,
    PgasPooledEmbeddingDist,
    PgasSparseFeaturesDist,
)
from torchrec_pgas.sharding.rw_exchange import RwExchange
from torchrec_pgas.sharding.table_wise import output_dtype
from torchrec_pgas.sharding.tw_base import TwFeature
from torchrec_pgas.transport import PgasTransportUnavailableError, get_transport
from torchrec_pgas.types import PGAS_ROW_WISE, PgasOptions


class PgasRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """``pgas_row_wise`` sharding of an ``EmbeddingBagCollection``.

    Args:
        sharding_infos: the tables of this sharding type, as TorchRec passes them.
        env: the sharding environment (process group, rank, world size).
        device: where the lookup runs (CPU: the host transport).
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
        self._exchange: Optional[RwExchange] = None

    def _get_exchange(self, device: Optional[torch.device]) -> RwExchange:
        if self._exchange is None:
            device = device or self._device or torch.device("cpu")
            if device.type != "cpu":
                raise PgasTransportUnavailableError(
                    f"{PGAS_ROW_WISE} runs on CPU (host transport) only so far; "
                    f"use row_wise or pgas_table_wise on {device.type}"
                )
            assert self._pg is not None
            tables_per_rank = [
                [t for config in configs for t in config.embedding_tables]
                for configs in self._grouped_embedding_configs_per_rank
            ]
            mine = tables_per_rank[self._rank]
            self._exchange = RwExchange(
                transport=get_transport(self._pg, device, self._options),
                features=[TwFeature(f, t.name, t.num_embeddings) for t in mine for f in t.feature_names],
                local_rows=[[t.local_rows for t in tables for _ in t.feature_names] for tables in tables_per_rank],
                dims=[t.embedding_dim for t in mine for _ in t.feature_names],
                mean=[t.pooling == PoolingType.MEAN for t in mine for _ in t.feature_names],
                out_dtype=self._out_dtype,
                headroom=self._options.headroom,
                name=PGAS_ROW_WISE,
            )
        return self._exchange

    def create_input_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return PgasSparseFeaturesDist(self._get_exchange(device))

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> PgasGroupedPooledEmbeddingsLookup:
        # ROW_WISE makes FBGEMM pool mean tables by sum: partial means cannot be added.
        return PgasGroupedPooledEmbeddingsLookup(
            name=PGAS_ROW_WISE,
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            sharding_type=ShardingType.ROW_WISE,
            env=self._env,
        )

    def create_output_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        return PgasPooledEmbeddingDist(self._get_exchange(device), PGAS_ROW_WISE)
