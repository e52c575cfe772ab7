"""``pgas_row_wise``: TorchRec's row-wise sharding with one-sided input and output
distributions.

Rows are placed, stored, looked up and optimized as TorchRec's ``row_wise`` does
(``RwPooledEmbeddingSharding``), so ``state_dict`` and checkpoints are interchangeable
with it; the bucketize + all-to-all and the reduce-scatter are replaced by the
exchange in ``rw_exchange`` (host transport) or ``rw_device_exchange`` (GPUs).
"""

from typing import Any, List

import torch
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType

from torchrec_pgas.kernels.ids_slot import Capacity
from torchrec_pgas.sharding.base import PgasShardingMixin, lookup_options
from torchrec_pgas.sharding.rw_exchange import RwExchange
from torchrec_pgas.sharding.tw_base import TwFeature
from torchrec_pgas.transport import get_transport
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE


def _rows_advice(world_size: int) -> str:
    """How to give a table rows on every rank: row blocks are ``ceil(rows / world)``,
    so having as many rows as ranks is not enough (4 rows on 3 ranks: 2, 2 and 0)."""
    return (
        f"give such a table a row count whose blocks of ceil(rows / {world_size}) reach every rank "
        f"({world_size - 1} * ceil(rows / {world_size}) < rows, e.g. a multiple of {world_size}), "
        f"or shard it {PGAS_TABLE_WISE}"
    )


def _refuse_empty_cpu_lookups(configs_per_rank: List[List[Any]]) -> None:
    """Row blocks are ``ceil(rows / world)``, so a small table can leave a rank no rows.
    FBGEMM's CPU lookup then fails on that rank alone when every table of a lookup
    group is empty there (no weights at all); its CPU backward updates the wrong
    rows of the group's other tables when their dims differ (the forward is right);
    and where the group's last table is empty, its CPU backward, which looks past an
    empty table for the next one's first row, reads past the end of the group's
    ``hash_size_cumsum`` (on that rank alone it then raises, or not, as the memory
    there has it). Refuse such plans, on every rank (the plan is the same everywhere),
    rather than fail on one rank or train silently wrong."""
    for rank, configs in enumerate(configs_per_rank):
        for config in configs:
            tables = config.embedding_tables
            empty = [t.name for t in tables if t.local_rows == 0]
            if not empty:
                continue
            if len(empty) == len(tables):
                why = (
                    "and no other table of their lookup group has rows there: FBGEMM's CPU lookup takes no empty group"
                )
            elif len({t.local_cols for t in tables}) > 1:
                why = "and share a lookup with tables of other dims, which FBGEMM's CPU backward updates wrongly"
            elif tables[-1].local_rows == 0:
                why = "and end their lookup group there, where FBGEMM's CPU backward reads past the group's row offsets"
            else:
                continue
            raise ValueError(
                f"{PGAS_ROW_WISE}: table(s) {empty} get no rows on rank {rank} (row blocks "
                f"are ceil(rows / world size)) {why}; {_rows_advice(len(configs_per_rank))}"
            )


def _refuse_ranks_without_rows(configs_per_rank: List[List[Any]]) -> None:
    """A rank that holds no row of any table has no lookup to run, which FBGEMM does
    not take: refuse the plan on every rank (it is the same on every rank) rather than
    fail on that rank alone."""
    empty = [
        rank
        for rank, configs in enumerate(configs_per_rank)
        if not any(t.local_rows > 0 for config in configs for t in config.embedding_tables)
    ]
    if empty:
        tables = sorted(t.name for config in configs_per_rank[empty[0]] for t in config.embedding_tables)
        raise ValueError(
            f"{PGAS_ROW_WISE}: ranks {empty} get no rows of any table: row blocks are "
            f"ceil(rows / {len(configs_per_rank)}), and none of tables {tables} reaches those "
            f"ranks; {_rows_advice(len(configs_per_rank))}"
        )


class PgasRwPooledEmbeddingSharding(PgasShardingMixin, RwPooledEmbeddingSharding):
    """``pgas_row_wise`` sharding of an ``EmbeddingBagCollection`` (arguments: see
    ``PgasShardingMixin``)."""

    pgas_name = PGAS_ROW_WISE
    # FBGEMM then pools mean tables by sum: partial means could not be added.
    lookup_sharding_type = ShardingType.ROW_WISE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_ranks_without_rows(self._grouped_embedding_configs_per_rank)
        if self._device is None or self._device.type == "cpu":
            _refuse_empty_cpu_lookups(self._grouped_embedding_configs_per_rank)

    def _make_exchange(self, device: torch.device) -> Any:
        assert self._pg is not None
        tables_per_rank = [
            [t for config in configs for t in config.embedding_tables]
            for configs in self._grouped_embedding_configs_per_rank
        ]
        mine = tables_per_rank[self._rank]
        transport = get_transport(self._pg, device, self._options)
        args = dict(
            features=[TwFeature(f, t.name, t.num_embeddings) for t in mine for f in t.feature_names],
            local_rows=[[t.local_rows for t in tables for _ in t.feature_names] for tables in tables_per_rank],
            dims=[t.embedding_dim for t in mine for _ in t.feature_names],
            mean=[t.pooling == PoolingType.MEAN for t in mine for _ in t.feature_names],
            out_dtype=self._out_dtype,
            capacity=Capacity.of(self._options),
            name=PGAS_ROW_WISE,
        )
        if transport.device.type != "cuda":
            return RwExchange(transport=transport, **args)
        from torchrec_pgas.sharding.rw_device_exchange import DeviceRwExchange

        lookup = lookup_options(self._grouped_embedding_configs, self._options)
        return DeviceRwExchange(transport=transport, **args, **lookup)  # type: ignore[arg-type]
