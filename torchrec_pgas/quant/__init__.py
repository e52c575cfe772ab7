"""``pgas_table_wise`` and ``pgas_row_wise`` serving of TorchRec's quantized
``EmbeddingBagCollection`` (INT8, INT4, FP16 tables) on CPUs or GPUs: one process per
rank, ids and pooled rows moved by the same one-sided exchanges as the float path
(NVSHMEM on GPUs, capturable in CUDA graphs), each owner pooling its tables (or row
blocks) with FBGEMM's int-N kernel (``IntNBitTableBatchedEmbeddingBagsCodegen``)."""

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
