"""Hand-written plans, the way ``torchrec.distributed.sharding_plan.table_wise`` does
them for TorchRec's own types::

    plan = construct_module_sharding_plan(ebc, {"t0": pgas_table_wise(rank=1)}, ...)
"""

import dataclasses
from typing import Optional

from torch import nn
from torchrec.distributed.sharding_plan import ParameterShardingGenerator, row_wise, table_wise
from torchrec.distributed.types import ModuleSharder, ParameterSharding

from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE


def pgas_table_wise(
    rank: int, device: Optional[str] = None, compute_kernel: Optional[str] = None
) -> ParameterShardingGenerator:
    """A ``ParameterShardingGenerator`` that places a whole table on ``rank`` with
    ``pgas_table_wise`` sharding (the layout of TorchRec's ``table_wise``)."""
    return _relabelled(table_wise(rank, device=device, compute_kernel=compute_kernel), PGAS_TABLE_WISE)


def _relabelled(generate: ParameterShardingGenerator, sharding_type: str) -> ParameterShardingGenerator:
    """``generate``'s plan, with the PGAS sharding type laid out like it."""

    def _generate(
        param: nn.Parameter,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder[nn.Module],
    ) -> ParameterSharding:
        sharding = generate(param, local_size, world_size, device_type, sharder)
        return dataclasses.replace(sharding, sharding_type=sharding_type)

    return _generate


def pgas_row_wise(compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """A ``ParameterShardingGenerator`` that splits a table's rows evenly over every rank
    with ``pgas_row_wise`` sharding (the layout of TorchRec's ``row_wise``)."""
    return _relabelled(row_wise(compute_kernel=compute_kernel), PGAS_ROW_WISE)
