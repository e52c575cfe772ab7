"""The models and batches a benchmark runs: the same weights and ids whatever the
sharding, so outputs can be compared bit for bit."""

from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM

from torchrec_pgas.benchmark.config import Config
from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding_plan import pgas_row_wise, pgas_table_wise

DENSE_FEATURES = 13

#: How each sharding type places table ``i`` over ``ranks`` ranks.
PLACEMENTS: Dict[str, Callable[[int, int], ParameterSharding]] = {
    "table_wise": lambda i, ranks: table_wise(rank=i % ranks, compute_kernel="fused"),
    "pgas_table_wise": lambda i, ranks: pgas_table_wise(rank=i % ranks, compute_kernel="fused"),
    "row_wise": lambda i, ranks: row_wise(compute_kernel="fused"),
    "pgas_row_wise": lambda i, ranks: pgas_row_wise(compute_kernel="fused"),
}


class _Holder(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


class _Dlrm(nn.Module):
    """TorchRec's DLRM on one batch of dense features and ids."""

    def __init__(self, ebc: EmbeddingBagCollection, dim: int, device: torch.device) -> None:
        super().__init__()
        self.model = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE_FEATURES,
            dense_arch_layer_sizes=[256, dim],
            over_arch_layer_sizes=[256, 1],
            dense_device=device,
        )

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.model(dense, kjt)


def _tables(cfg: Config) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f"f{i}"])
        for i in range(cfg.tables)
    ]


def build(
    cfg: Config, sharding: str, device: torch.device, pg: dist.ProcessGroup, dlrm: bool = False
) -> DistributedModelParallel:
    """An EBC (or a DLRM around it) with every table sharded by ``sharding`` over
    ``pg``, trained by fused ``EXACT_SGD``, with weights drawn per table from its seed."""
    torch.manual_seed(0)  # the DLRM's dense layers: the same on every rank and sharding
    ebc = EmbeddingBagCollection(tables=_tables(cfg), device=torch.device("meta"))
    module: nn.Module = _Dlrm(ebc, cfg.dim, device) if dlrm else _Holder(ebc)
    path = "model.sparse_arch.embedding_bag_collection" if dlrm else "ebc"
    sharder = PgasEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01}
    )
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={t.name: PLACEMENTS[sharding](i, cfg.ranks) for i, t in enumerate(_tables(cfg))},
        world_size=cfg.ranks,
        local_size=cfg.ranks,
        device_type=device.type,
        sharder=sharder,
    )
    dmp = DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=ShardingPlan({path: plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    for key, value in dmp.state_dict().items():
        if "embedding_bags.t" not in key:
            continue
        table = int(key.split("embedding_bags.t")[1].split(".")[0])
        g = torch.Generator(device=device).manual_seed(table)
        full = torch.rand(cfg.rows, cfg.dim, generator=g, device=device) * 0.02 - 0.01
        for shard in value.local_shards():
            (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.detach().copy_(full[r : r + nr, c : c + nc])
    return dmp


def batches(cfg: Config, device: torch.device, n: int, rank: int) -> List[KeyedJaggedTensor]:
    """``n`` batches of ``cfg.batch_size`` samples with ``cfg.ids_per_bag`` ids per bag."""
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    lengths = torch.full((cfg.tables * cfg.batch_size,), cfg.ids_per_bag, dtype=torch.int64, device=device)
    count = cfg.tables * cfg.batch_size * cfg.ids_per_bag
    if cfg.zipf_alpha:
        # Row k (1-based) drawn with probability proportional to k^-alpha, hot rows
        # scattered over the table by a fixed permutation.
        weights = torch.arange(1, cfg.rows + 1, device=device, dtype=torch.float64).pow(-cfg.zipf_alpha)
        scatter = torch.randperm(cfg.rows, generator=torch.Generator(device=device).manual_seed(7), device=device)
        draw = lambda: scatter[torch.multinomial(weights, count, replacement=True, generator=g)]  # noqa: E731
    else:
        draw = lambda: torch.randint(0, cfg.rows, (count,), generator=g, device=device)  # noqa: E731
    keys = [f"f{i}" for i in range(cfg.tables)]
    return [KeyedJaggedTensor(keys=keys, values=draw(), lengths=lengths) for _ in range(n)]


def steps(
    model: nn.Module, kjts: List[KeyedJaggedTensor], grads: List[torch.Tensor]
) -> Tuple[Callable[[int], None], Callable[[int], None]]:
    """The forward (inference) and the training step of ``model`` on batch ``i``
    (cycling through ``kjts``, with the output gradients ``grads``)."""

    def forward(i: int) -> None:
        with torch.no_grad():
            model(kjts[i % len(kjts)])

    def train_step(i: int) -> None:
        model(kjts[i % len(kjts)]).backward(grads[i % len(grads)])

    return forward, train_step


def dense_features(cfg: Config, device: torch.device, n: int, rank: int) -> List[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(2000 + rank)
    return [torch.rand(cfg.batch_size, DENSE_FEATURES, generator=g, device=device) for _ in range(n)]
