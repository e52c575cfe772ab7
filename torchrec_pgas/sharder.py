"""The sharder and sharded module that put the PGAS sharding types into TorchRec."""

from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_SHARDING_TYPES, PGAS_TABLE_WISE, PgasOptions


class ShardedPgasEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """A ``ShardedEmbeddingBagCollection`` that also builds the PGAS sharding types.

    TorchRec's own sharding types are built exactly as TorchRec builds them, so one
    module can mix ``pgas_table_wise`` tables with ``table_wise`` or ``row_wise`` ones.
    """

    def __init__(self, *args: Any, pgas_options: PgasOptions, **kwargs: Any) -> None:
        # The parent constructor calls create_embedding_bag_sharding, which needs the
        # options, before nn.Module.__init__ has run: bypass Module.__setattr__.
        object.__setattr__(self, "_pgas_options", pgas_options)
        super().__init__(*args, **kwargs)

    def create_embedding_bag_sharding(  # type: ignore[override]
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        if sharding_type == PGAS_TABLE_WISE:
            from torchrec_pgas.sharding.table_wise import PgasTwPooledEmbeddingSharding

            return PgasTwPooledEmbeddingSharding(
                sharding_infos, env, device, options=self._pgas_options
            )
        if sharding_type == PGAS_ROW_WISE:
            from torchrec_pgas.sharding.row_wise import PgasRwPooledEmbeddingSharding

            return PgasRwPooledEmbeddingSharding(
                sharding_infos, env, device, options=self._pgas_options
            )
        return super().create_embedding_bag_sharding(
            sharding_infos,
            env,
            device,
            permute_embeddings=permute_embeddings,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )


class PgasEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` that offers the PGAS sharding types too.

    Args:
        fused_params: forwarded to TorchRec (optimizer, learning rate, ...).
        qcomm_codecs_registry: forwarded to TorchRec for its own sharding types.
        options: run-time options of the PGAS sharding types.
    """

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        options: Optional[PgasOptions] = None,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._pgas_options = options or PgasOptions()

    def sharding_types(self, compute_device_type: str) -> List[str]:
        # pgas_row_wise has no GPU path yet: never offer it where it would raise.
        pgas = [t for t in PGAS_SHARDING_TYPES if t != PGAS_ROW_WISE or compute_device_type == "cpu"]
        return super().sharding_types(compute_device_type) + pgas

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ShardedPgasEmbeddingBagCollection:
        return ShardedPgasEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
            pgas_options=self._pgas_options,
        )
