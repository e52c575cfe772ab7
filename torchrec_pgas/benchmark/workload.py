"""The models and batches a benchmark runs: the same weights and ids whatever the
sharding, so outputs can be compared bit for bit."""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    ParameterShardingGenerator,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM

from torchrec_pgas.benchmark.config import Config, TableSpec, table_specs
from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding_plan import pgas_row_wise, pgas_table_wise
from torchrec_pgas.types import PgasOptions

DENSE_FEATURES = 13

#: How each sharding type places a table whose table-wise owner is the given rank.
PLACEMENTS: Dict[str, Callable[[int], ParameterShardingGenerator]] = {
    "table_wise": lambda rank: table_wise(rank=rank, compute_kernel="fused"),
    "pgas_table_wise": lambda rank: pgas_table_wise(rank=rank, compute_kernel="fused"),
    "row_wise": lambda rank: row_wise(compute_kernel="fused"),
    "pgas_row_wise": lambda rank: pgas_row_wise(compute_kernel="fused"),
}

#: ``Config.optimizer``'s FBGEMM optimizers.
_OPTIMIZERS = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}


def placement(sharding: str, spec: TableSpec) -> ParameterShardingGenerator:
    """``spec``'s sharding under ``sharding``: one sharding type for every table, or
    "SMALL+BIG" (``pgas_table_wise+pgas_row_wise``): the second for the tables the
    plan puts row-wise, the first for the rest, in one module."""
    kinds = sharding.split("+")
    if len(kinds) > 2 or any(k not in PLACEMENTS for k in kinds):
        raise ValueError(f"unknown sharding {sharding!r}: expected one of {sorted(PLACEMENTS)} or SMALL+BIG of them")
    return PLACEMENTS[kinds[-1] if spec.row_wise else kinds[0]](spec.rank)


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
        # Its interaction indices (a buffer) are made on the CPU: each step would copy them.
        self.model.inter_arch.to(device)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.model(dense, kjt)


def embedding_configs(cfg: Config) -> List[EmbeddingBagConfig]:
    """Table ``t{i}`` of ``table_specs(cfg)`` looked up by feature ``f{i}``."""
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=cfg.dim, num_embeddings=s.rows, feature_names=[f"f{i}"])
        for i, s in enumerate(table_specs(cfg))
    ]


def module_plan(
    cfg: Config,
    sharding: str,
    ebc: EmbeddingBagCollection,
    device_type: str,
    sharder: PgasEmbeddingBagCollectionSharder,
) -> EmbeddingModuleShardingPlan:
    """The plan of ``cfg``'s tables in ``ebc``, each placed by ``placement``: one
    module whatever the mix of sharding types."""
    return construct_module_sharding_plan(
        ebc,
        per_param_sharding={f"t{i}": placement(sharding, s) for i, s in enumerate(table_specs(cfg))},
        world_size=cfg.ranks,
        local_size=cfg.ranks,
        device_type=device_type,
        sharder=sharder,
    )


def build(
    cfg: Config,
    sharding: str,
    device: torch.device,
    pg: dist.ProcessGroup,
    dlrm: bool = False,
    options: Optional[PgasOptions] = None,
) -> DistributedModelParallel:
    """An EBC (or a DLRM around it) with its tables sharded by ``sharding`` (see
    ``placement``) over ``pg``, trained by the fused ``cfg.optimizer``, with weights
    drawn per table from its seed; PGAS shardings take ``options``."""
    torch.manual_seed(0)  # the DLRM's dense layers: the same on every rank and sharding
    ebc = EmbeddingBagCollection(tables=embedding_configs(cfg), device=torch.device("meta"))
    module: nn.Module = _Dlrm(ebc, cfg.dim, device) if dlrm else _Holder(ebc)
    path = "model.sparse_arch.embedding_bag_collection" if dlrm else "ebc"
    sharder = PgasEmbeddingBagCollectionSharder(
        fused_params={"optimizer": _OPTIMIZERS[cfg.optimizer], "learning_rate": 0.01}, options=options
    )
    plan = module_plan(cfg, sharding, ebc, device.type, sharder)
    dmp = DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=ShardingPlan({path: plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    specs = table_specs(cfg)
    for key, value in dmp.state_dict().items():
        if "embedding_bags.t" not in key:
            continue
        table = int(key.split("embedding_bags.t")[1].split(".")[0])
        g = torch.Generator(device=device).manual_seed(table)
        full = torch.rand(specs[table].rows, cfg.dim, generator=g, device=device) * 0.02 - 0.01
        for shard in value.local_shards():
            (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.detach().copy_(full[r : r + nr, c : c + nc])
    return dmp


def _draw(
    spec: TableSpec, count: int, zipf_alpha: float, seed: int, g: torch.Generator, device: torch.device
) -> Callable[[], torch.Tensor]:
    """``count`` ids of one table per call: uniform, or row k (1-based) with probability
    proportional to k^-alpha, the hot rows scattered over the table by a permutation
    fixed per table (so that row-wise shards each get some)."""
    if not zipf_alpha:
        return lambda: torch.randint(0, spec.rows, (count,), generator=g, device=device)
    # Inverse CDF rather than ``torch.multinomial``, which takes at most 2^24 rows on GPUs.
    cdf = torch.arange(1, spec.rows + 1, device=device, dtype=torch.float64).pow(-zipf_alpha).cumsum(0)
    cdf /= cdf[-1].clone()
    scatter = torch.randperm(spec.rows, generator=torch.Generator(device=device).manual_seed(seed), device=device)

    def draw() -> torch.Tensor:
        u = torch.rand(count, generator=g, device=device, dtype=torch.float64)
        return scatter[torch.searchsorted(cdf, u, right=True).clamp_(max=spec.rows - 1)]

    return draw


def batches(cfg: Config, device: torch.device, n: int, rank: int) -> List[KeyedJaggedTensor]:
    """``n`` batches of ``cfg.batch_size`` samples, each table's bags of its
    ``ids_per_bag`` ids."""
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    specs = table_specs(cfg)
    lengths = torch.tensor([s.ids_per_bag for s in specs], dtype=torch.int64, device=device)
    lengths = lengths.repeat_interleave(cfg.batch_size)
    draws = [_draw(s, cfg.batch_size * s.ids_per_bag, cfg.zipf_alpha, 7 + i, g, device) for i, s in enumerate(specs)]
    keys = [f"f{i}" for i in range(len(specs))]
    return [
        KeyedJaggedTensor(keys=keys, values=torch.cat([draw() for draw in draws]), lengths=lengths) for _ in range(n)
    ]


def pooled_by_table(model: DistributedModelParallel, kjt: KeyedJaggedTensor) -> torch.Tensor:
    """The EBC's pooled rows of ``kjt`` as [batch, tables, dim] in table order: a
    sharded EBC orders its output keys by its own grouping (by owner, by sharding
    type), which differs between shardings of the same tables."""
    with torch.no_grad():
        pooled = model.module.ebc(kjt).to_dict()
    return torch.stack([pooled[key] for key in kjt.keys()], dim=1).clone()


def step_fns(
    model: nn.Module,
) -> Tuple[Callable[[KeyedJaggedTensor], torch.Tensor], Callable[[KeyedJaggedTensor, torch.Tensor], torch.Tensor]]:
    """The forward (inference) and the training step (forward, then backward of the
    given output gradient; the fused optimizer steps inside it) of ``model`` on one
    batch, each returning its output: the same callables run eagerly and captured
    in a CUDA graph (``--cuda-graph``), which needs a step's outputs to be tensors."""

    def forward(kjt: KeyedJaggedTensor) -> torch.Tensor:
        with torch.no_grad():
            return model(kjt)

    def train_step(kjt: KeyedJaggedTensor, grad: torch.Tensor) -> torch.Tensor:
        out = model(kjt)
        out.backward(grad)
        return out.detach()

    return forward, train_step


def dlrm_inference(model: nn.Module) -> Callable[[torch.Tensor, KeyedJaggedTensor], torch.Tensor]:
    """The DLRM's inference on one batch of dense features and ids, returning its
    predictions (see ``step_fns``)."""

    def infer(dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        with torch.no_grad():
            return model(dense, kjt)

    return infer


def cycle(fn: Callable[..., object], inputs: Sequence[Tuple[object, ...]]) -> Callable[[int], None]:
    """``fn`` on the ``i``-th of ``inputs`` (cycling through them): a step for
    ``timing.median_ms``."""

    def step(i: int) -> None:
        fn(*inputs[i % len(inputs)])

    return step


def steps(
    model: nn.Module, kjts: List[KeyedJaggedTensor], grads: List[torch.Tensor]
) -> Tuple[Callable[[int], None], Callable[[int], None]]:
    """The forward (inference) and the training step of ``model`` on batch ``i``
    (cycling through ``kjts``, with the output gradients ``grads``)."""
    forward, train_step = step_fns(model)
    return cycle(forward, [(kjt,) for kjt in kjts]), cycle(train_step, list(zip(kjts, grads)))


def dense_features(cfg: Config, device: torch.device, n: int, rank: int) -> List[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(2000 + rank)
    return [torch.rand(cfg.batch_size, DENSE_FEATURES, generator=g, device=device) for _ in range(n)]
