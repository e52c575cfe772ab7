"""``pgas_table_wise``: TorchRec's table-wise sharding with one-sided input and output
distributions.

Tables are placed, stored, looked up and optimized exactly as TorchRec's
``table_wise`` does (``TwPooledEmbeddingSharding`` and its
``GroupedPooledEmbeddingsLookup``), so ``state_dict``, checkpoints and fused
optimizers behave identically. Only the two collectives are replaced: see
``tw_exchange`` for the algorithm.
"""

from typing import Any, List

import torch
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding

from torchrec_pgas.kernels.ids_slot import Capacity
from torchrec_pgas.sharding.base import PgasShardingMixin, lookup_options
from torchrec_pgas.sharding.tw_base import TwFeature
from torchrec_pgas.sharding.tw_exchange import TwExchange
from torchrec_pgas.transport import get_transport
from torchrec_pgas.types import PGAS_TABLE_WISE


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


class PgasTwPooledEmbeddingSharding(PgasShardingMixin, TwPooledEmbeddingSharding):
    """``pgas_table_wise`` sharding of an ``EmbeddingBagCollection`` (arguments: see
    ``PgasShardingMixin``)."""

    pgas_name = PGAS_TABLE_WISE

    def _make_exchange(self, device: torch.device) -> Any:
        assert self._pg is not None
        transport = get_transport(self._pg, device, self._options)
        args = dict(
            features_per_rank=_features_per_rank(self),
            dim_sum_per_rank=self._dim_sum_per_rank(),
            out_dtype=self._out_dtype,
            capacity=Capacity.of(self._options),
            name=PGAS_TABLE_WISE,
        )
        if transport.device.type != "cuda":
            return TwExchange(transport=transport, **args)
        from torchrec_pgas.sharding.tw_device_exchange import DeviceTwExchange

        lookup = lookup_options(self._grouped_embedding_configs, self._options)
        return DeviceTwExchange(transport=transport, **args, **lookup)  # type: ignore[arg-type]
