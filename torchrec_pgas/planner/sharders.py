"""Sharder lists that offer the PGAS sharding types."""

from typing import Any, Dict, List, Optional

from torch import nn
from torchrec.distributed import sharding_plan
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.types import PgasOptions


def with_pgas_ebc_sharder(
    sharders: List[ModuleSharder[nn.Module]],
    fused_params: Optional[Dict[str, Any]] = None,
    options: Optional[PgasOptions] = None,
) -> List[ModuleSharder[nn.Module]]:
    """``sharders`` with the ``EmbeddingBagCollection`` sharder replaced by ours.

    The replacement keeps its position; DMP keys sharders by ``module_type`` and the
    last one wins, so exactly one EBC sharder is left. Appended if there was none.

    Args:
        sharders: the sharders to start from, typically TorchRec's defaults.
        fused_params: forwarded to ``PgasEmbeddingBagCollectionSharder``.
        options: forwarded to ``PgasEmbeddingBagCollectionSharder``.
    """
    ours: ModuleSharder[nn.Module] = PgasEmbeddingBagCollectionSharder(  # type: ignore[assignment]
        fused_params=fused_params, options=options
    )
    result = [s for s in sharders if s.module_type is not EmbeddingBagCollection]
    index = next(
        (i for i, s in enumerate(sharders) if s.module_type is EmbeddingBagCollection),
        len(result),
    )
    result.insert(index, ours)
    return result


def pgas_sharders(
    fused_params: Optional[Dict[str, Any]] = None,
    options: Optional[PgasOptions] = None,
) -> List[ModuleSharder[nn.Module]]:
    """TorchRec's default sharders, with ``PgasEmbeddingBagCollectionSharder`` for EBCs.

    Args:
        fused_params: for the EBC sharder (optimizer, learning rate, ...); the other
            sharders keep TorchRec's defaults.
        options: run-time options of the PGAS sharding types.
    """
    return with_pgas_ebc_sharder(sharding_plan.get_default_sharders(), fused_params, options)
