"""An ``EmbeddingShardingPlanner`` that understands the PGAS types without ``register()``.

TorchRec's enumerator, storage estimator and stats call the module-level functions that
reject unknown sharding types directly, not through anything a planner can be handed;
replacing them would mean copying TorchRec's enumeration loop, storage estimate and
stats table, which change between releases. So this planner opens
``registration.scoped_registration()`` around ``plan()`` and ``collective_plan()``
only: the patches exist while it plans and are gone when it returns (unless
``register()`` is in force anyway).
"""

from typing import Any, Dict, List, Optional

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from torchrec_pgas.planner.constraints import check_constraint_sharding_types
from torchrec_pgas.planner.registration import scoped_registration
from torchrec_pgas.planner.sharders import pgas_sharders


class PgasShardingPlanner(EmbeddingShardingPlanner):
    """``EmbeddingShardingPlanner`` that plans PGAS sharding types too.

    Takes ``EmbeddingShardingPlanner``'s arguments. Constraints naming unknown sharding
    types are rejected here, at construction. ``collective_plan`` without sharders
    uses ``pgas_sharders()``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_constraint_sharding_types(self._constraints)

    def plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        with scoped_registration():
            return super().plan(module, sharders)

    def collective_plan(
        self,
        module: nn.Module,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
        pg: Optional[dist.ProcessGroup] = None,
    ) -> ShardingPlan:
        with scoped_registration():
            return super().collective_plan(module, pgas_sharders() if sharders is None else sharders, pg)


def make_planner(
    topology: Topology,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    **kwargs: Any,
) -> EmbeddingShardingPlanner:
    """A planner for modules mixing PGAS and TorchRec sharding types.

    Args:
        topology: the devices to plan for.
        constraints: per-table constraints; may name PGAS sharding types.
        **kwargs: any other ``EmbeddingShardingPlanner`` argument.

    Raises:
        ValueError: if a constraint names an unknown sharding type.
    """
    return PgasShardingPlanner(topology=topology, constraints=constraints, **kwargs)
