"""Hand-written plans, the way ``torchrec.distributed.sharding_plan.table_wise`` does
them for TorchRec's own types::

    plan = construct_module_sharding_plan(ebc, {"t0": pgas_table_wise(rank=1)}, ...)
"""

import dataclasses
from typing import Optional

from torch import nn
from torchrec.distributed.sharding_plan import ParameterShardingGenerator, table_wise
from torchrec.distributed.types import ModuleSharder, ParameterSharding

from torchrec_pgas.types import PGAS_TABLE_WISE


def pgas_table_wise(
    rank: int, device: Optional[str] = None, compute_kernel: Optional[str] = None
) -> ParameterShardingGenerator:
    """A ``ParameterShardingGenerator`` that places a whole table on ``rank`` with
    ``pgas_table_wise`` sharding (the layout of TorchRec's ``table_wise``)."""
    generate_tw = table_wise(rank, device=device, compute_kernel=compute_kernel)

    def _generate(
        param: nn.Parameter,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder[nn.Module],
    ) -> ParameterSharding:
        sharding = generate_tw(param, local_size, world_size, device_type, sharder)
        return dataclasses.replace(sharding, sharding_type=PGAS_TABLE_WISE)

    return _generate
