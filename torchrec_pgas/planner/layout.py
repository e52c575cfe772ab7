"""Which TorchRec sharding type each PGAS sharding type is laid out like.

A PGAS sharding type places and sizes its shards exactly like one of TorchRec's own
types; only the input and output distributions differ. Every planner hook (shard sizes
and offsets, partitioning, storage io sizes) therefore answers for a PGAS type what it
answers for that TorchRec type, and this table is the one place that says which.
"""

from dataclasses import dataclass
from types import MappingProxyType
from typing import List, Mapping

from torchrec.distributed.types import ShardingType

from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_SHARDING_TYPES, PGAS_TABLE_WISE


@dataclass(frozen=True)
class PgasLayout:
    """How the planner sees one PGAS sharding type.

    Args:
        torchrec_type: the TorchRec sharding type whose shard sizes, offsets,
            partitioning and storage io sizes it shares.
        abbreviation: its short name in the planner's stats table.
    """

    torchrec_type: str
    abbreviation: str


PGAS_LAYOUTS: Mapping[str, PgasLayout] = MappingProxyType(
    {
        PGAS_TABLE_WISE: PgasLayout(ShardingType.TABLE_WISE.value, "PTW"),
        PGAS_ROW_WISE: PgasLayout(ShardingType.ROW_WISE.value, "PRW"),
    }
)

# A PGAS type added to types.py without a layout would reach TorchRec's planner
# unmapped and fail deep inside it; fail here, at import, instead.
if set(PGAS_LAYOUTS) != set(PGAS_SHARDING_TYPES):
    raise ImportError(
        f"torchrec_pgas.planner.layout maps {sorted(PGAS_LAYOUTS)} but "
        f"PGAS_SHARDING_TYPES is {sorted(PGAS_SHARDING_TYPES)}"
    )


def torchrec_layout(sharding_type: str) -> str:
    """The TorchRec sharding type ``sharding_type`` is laid out like (itself if not PGAS)."""
    layout = PGAS_LAYOUTS.get(sharding_type)
    return layout.torchrec_type if layout else sharding_type


def known_sharding_types() -> List[str]:
    """Every sharding type the planner understands: TorchRec's and the PGAS ones."""
    return [t.value for t in ShardingType] + list(PGAS_SHARDING_TYPES)
