"""Rejects ParameterConstraints that name sharding types nobody implements.

TorchRec intersects a constraint's ``sharding_types`` with what the sharder offers, so a
misspelt type is silently dropped when another type is listed beside it, and otherwise
surfaces as "No available sharding type ..." without naming the culprit.
"""

from typing import Mapping, Optional

from torchrec.distributed.planner.types import ParameterConstraints

from torchrec_pgas.planner.layout import known_sharding_types


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
