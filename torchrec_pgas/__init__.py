"""TorchRec sharding types whose input and output distributions are one-sided puts.

Importing this package is cheap: TorchRec is only imported when one of the names
below that needs it is first used (``register`` is also the ``torchrec.plugins``
entry point ``pgas``).
"""

import importlib
from typing import TYPE_CHECKING, Any

from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_SHARDING_TYPES, PGAS_TABLE_WISE, PgasOptions

if TYPE_CHECKING:
    from torchrec_pgas.graphs import CapturedStep, capture, pgas_exchanges, raise_errors
    from torchrec_pgas.planner.registration import is_registered, register, unregister
    from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
    from torchrec_pgas.sharding_plan import pgas_row_wise, pgas_table_wise

__all__ = [
    "CapturedStep",
    "PGAS_ROW_WISE",
    "PGAS_SHARDING_TYPES",
    "PGAS_TABLE_WISE",
    "PgasEmbeddingBagCollectionSharder",
    "PgasOptions",
    "capture",
    "is_registered",
    "pgas_exchanges",
    "pgas_row_wise",
    "pgas_table_wise",
    "raise_errors",
    "register",
    "unregister",
]

# Exported name -> module defining it, imported on first use (PEP 562).
_LAZY = {
    "CapturedStep": "torchrec_pgas.graphs",
    "PgasEmbeddingBagCollectionSharder": "torchrec_pgas.sharder",
    "capture": "torchrec_pgas.graphs",
    "is_registered": "torchrec_pgas.planner.registration",
    "pgas_exchanges": "torchrec_pgas.graphs",
    "pgas_row_wise": "torchrec_pgas.sharding_plan",
    "pgas_table_wise": "torchrec_pgas.sharding_plan",
    "raise_errors": "torchrec_pgas.graphs",
    "register": "torchrec_pgas.planner.registration",
    "unregister": "torchrec_pgas.planner.registration",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
