"""What the PGAS ``EmbeddingSharding`` subclasses share: options, dists and lookup.

A PGAS sharding is a TorchRec sharding (placement, lookup, state) whose input and
output dists are ``dists.py``'s, driven by an exchange the subclass builds on first
use in ``_make_exchange``.
"""

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor, EmbeddingComputeKernel
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType

from torchrec_pgas.kernels.ids_slot import Status
from torchrec_pgas.sharding.dists import (
    PgasGroupedPooledEmbeddingsLookup,
    PgasPooledEmbeddingDist,
    PgasSparseFeaturesDist,
)
from torchrec_pgas.sharding.exchange import Exchange, LookupInput, PooledLookup
from torchrec_pgas.sharding.tw_base import setup_failed_earlier
from torchrec_pgas.types import PgasOptions


def lookup_options(configs: List[Any], options: PgasOptions) -> Dict[str, Any]:
    """What the GPU exchanges need to know of the owner's lookup groups."""
    fused = all(c.compute_kernel == EmbeddingComputeKernel.FUSED for c in configs)
    return dict(
        group_sizes=[c.num_features() for c in configs],
        weighted=any(c.is_weighted for c in configs),
        # Caching kernels prefetch over the whole index tensor, and FBGEMM's bounds
        # check may be forced on from the environment: both read past the bags.
        lookup_reads_only_bags=fused and "FBGEMM_TBE_BOUNDS_CHECK_MODE" not in os.environ,
        fused_lookup=fused
        and all(c.pooling in (PoolingType.SUM, PoolingType.MEAN) and not c.has_feature_processor for c in configs),
        fused_update=options.sparse_update == "fused",
    )


def output_dtype(sharding_infos: List[EmbeddingShardingInfo]) -> torch.dtype:
    """The pooled embeddings' dtype (TorchRec's ``output_dtype`` fused parameter)."""
    fused = sharding_infos[0].fused_params or {}
    dtype = fused.get("output_dtype")
    return dtype.as_dtype() if dtype is not None else torch.float32


class PgasShardingMixin:
    """Put first in the bases of a TorchRec ``EmbeddingSharding`` subclass.

    Args:
        sharding_infos: the tables of this sharding type, as TorchRec passes them.
        env: the sharding environment (process group, rank, world size).
        device: where the lookup runs (CPU: the host transport).
        options: run-time options (timeouts, capacity headroom, transport).
    """

    #: The sharding type's name, for messages and routes.
    pgas_name: str
    #: What TorchRec's lookup is told the sharding type is (it picks pooling modes by it).
    lookup_sharding_type: Optional[ShardingType] = None

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        options: Optional[PgasOptions] = None,
    ) -> None:
        super().__init__(sharding_infos, env, device)  # type: ignore[call-arg]
        self._options = options or PgasOptions()
        self._out_dtype = output_dtype(sharding_infos)
        self._exchange: Optional[Exchange] = None
        self._setup_error: Optional[BaseException] = None

    @property
    def exchange(self) -> Optional[Exchange]:
        """The sharding's exchange, once made (at the first lookup's creation)."""
        return self._exchange

    def _make_exchange(self, device: torch.device) -> Exchange:
        raise NotImplementedError

    def _get_exchange(self, device: Optional[torch.device]) -> Exchange:
        # Created on first use, collectively: every rank builds its dists in the
        # same order. A set-up that failed is not retried (its peers would not take
        # part again): every later call raises its error.
        if self._setup_error is not None:
            raise setup_failed_earlier(self.pgas_name, self._setup_error) from self._setup_error
        if self._exchange is None:
            try:
                self._exchange = self._make_exchange(device or self._device or torch.device("cpu"))  # type: ignore[attr-defined]
            except BaseException as e:
                self._setup_error = e
                raise
        return self._exchange

    def report_input_problem(self, status: Optional[Status], detail: Optional[Tuple[Any, ...]]) -> None:
        """See ``BaseTwExchange.report_input_problem``."""
        self._get_exchange(None).report_input_problem(status, detail)

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[LookupInput]:
        return PgasSparseFeaturesDist(self._get_exchange(device))

    def create_output_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, PooledLookup, torch.Tensor]:
        return PgasPooledEmbeddingDist(self._get_exchange(device), self.pgas_name)

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> PgasGroupedPooledEmbeddingsLookup:
        kwargs = {"sharding_type": self.lookup_sharding_type} if self.lookup_sharding_type else {}
        device = device if device is not None else self._device  # type: ignore[attr-defined]
        if device is not None and device.type == "cuda":
            # Sources check every id before sending it, and the GPU lookup's index
            # tensor may be longer than its bags (tw_device_exchange): FBGEMM's own
            # check would be redundant, and would stretch the last bag over the rest.
            for config in self._grouped_embedding_configs:  # type: ignore[attr-defined]
                config.fused_params = {**(config.fused_params or {}), "bounds_check_mode": BoundsCheckMode.NONE}
        # The lookup's exchange is made here, collectively (TorchRec creates every
        # sharding's lookup in the same order on every rank, before its dists).
        return PgasGroupedPooledEmbeddingsLookup(
            exchange=self._get_exchange(device),
            grouped_configs=self._grouped_embedding_configs,  # type: ignore[attr-defined]
            pg=self._pg,  # type: ignore[attr-defined]
            device=device,
            feature_processor=feature_processor,
            env=self._env,  # type: ignore[attr-defined]
            **kwargs,
        )
