"""Rejects ParameterConstraints that name sharding types nobody implements, or PGAS
types for tables whose module no PGAS sharder shards.

TorchRec intersects a constraint's ``sharding_types`` with what the sharder offers, so a
misspelt type is silently dropped when another type is listed beside it, and otherwise
surfaces as "No available sharding type ..." without naming the culprit; and
``collective_plan`` plans on rank 0 alone, so that error leaves the other ranks waiting
for the plan. Both checks run on every rank before planning.
"""

from typing import Any, List, Mapping, Optional

from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.planner.utils import sharder_name
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

from torchrec_pgas.planner.layout import known_sharding_types
from torchrec_pgas.types import PGAS_SHARDING_TYPES


def check_constraint_sharding_types(
    constraints: Optional[Mapping[str, ParameterConstraints]],
) -> None:
    """Raise ``ValueError`` if a constraint names an unknown sharding type.

    Args:
        constraints: the planner's constraints, keyed by table name.

    Raises:
        ValueError: naming the table, the unknown types and every valid type.
    """
    valid = known_sharding_types()
    for name, constraint in (constraints or {}).items():
        unknown = [t for t in constraint.sharding_types or [] if t not in valid]
        if unknown:
            raise ValueError(
                f"ParameterConstraints for table {name!r} name unknown sharding "
                f"type(s) {unknown!r}; valid sharding types are {valid}"
            )


def check_constraints_fit_sharders(
    constraints: Optional[Mapping[str, ParameterConstraints]],
    module: nn.Module,
    sharders: List[Any],
    compute_device: str,
) -> None:
    """Raise ``ValueError`` if a constraint leaves a table only PGAS sharding types its
    module's sharder does not offer (an ``EmbeddingCollection``'s, a
    ``FeatureProcessedEmbeddingBagCollection``'s: the PGAS types shard
    ``EmbeddingBagCollection`` tables).

    Args:
        constraints: the planner's constraints, keyed by table name.
        module: the module to plan.
        sharders: the sharders the planner is given.
        compute_device: the topology's compute device type.

    Raises:
        ValueError: naming the table, its module's type and the types its sharder offers.
    """
    if not constraints:
        return
    by_module = {sharder_name(s.module_type): s for s in sharders}
    for path, child in module.named_modules():
        sharder = by_module.get(sharder_name(type(child)))
        if sharder is None:
            continue
        offered = sharder.sharding_types(compute_device)
        for table in sharder.shardable_parameters(child):
            wanted = constraints[table].sharding_types if table in constraints else None
            if not wanted or set(wanted) & set(offered) or not set(wanted) & set(PGAS_SHARDING_TYPES):
                continue
            raise ValueError(
                f"ParameterConstraints for table {table!r} allow only {wanted!r}, but the table is in "
                f"{type(child).__name__} {path!r}, whose sharder ({type(sharder).__name__}) offers {offered}: "
                + _fix(child)
            )


def _fix(module: nn.Module) -> str:
    """What to do where a constraint wants PGAS types that ``module``'s sharder lacks."""
    if type(module) is EmbeddingBagCollection:
        return (
            "plan and shard it with PgasEmbeddingBagCollectionSharder (torchrec_pgas.planner.pgas_sharders(), "
            "or sharders=None after torchrec_pgas.register())"
        )
    if type(module) is QuantEmbeddingBagCollection:
        return "shard quantized tables with torchrec_pgas.quant.shard_quant_model"
    return (
        "the PGAS sharding types shard EmbeddingBagCollection tables (quantized ones through "
        "torchrec_pgas.quant.shard_quant_model); allow one of the offered types for this table"
    )
