"""``pgas_table_wise`` serving of TorchRec's quantized ``EmbeddingBagCollection``
(INT8, INT4, FP16 tables): one process per rank, ids and pooled rows moved by the
same one-sided exchange as the float path, each owner pooling its tables with
FBGEMM's int-N kernel (``IntNBitTableBatchedEmbeddingBagsCodegen``)."""

from torchrec_pgas.quant.sharded import (
    PgasQuantEmbeddingBagCollection,
    PgasQuantEmbeddingBagCollectionSharder,
    balanced_owners,
    plan_quant_model,
    shard_quant_model,
)

__all__ = [
    "PgasQuantEmbeddingBagCollection",
    "PgasQuantEmbeddingBagCollectionSharder",
    "balanced_owners",
    "plan_quant_model",
    "shard_quant_model",
]
