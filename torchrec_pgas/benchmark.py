"""``pgas_table_wise`` against TorchRec's ``table_wise`` (FBGEMM FUSED + NCCL), side by
side in one process group, on the same weights and batches.

    torchrun --standalone --nproc_per_node=2 -m torchrec_pgas.benchmark            # R1
    torchrun --standalone --nproc_per_node=2 -m torchrec_pgas.benchmark --rows 100000

Reports, per sharding type, the median over ``--iters`` iterations (after warm-up,
CUDA events) of the embedding forward (inference, no grad) and of a training step
(forward, backward and the fused optimizer update), the ratios, and whether the two
outputs agree. Reference config R1 is the default: 8 tables x 1M rows x dim 128 fp32,
8192 samples per rank, 20 ids per bag, uniform ids.
"""

import argparse
import json
import statistics
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from tqdm import tqdm

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding_plan import pgas_table_wise


class _Holder(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The model and batch arguments (reference config R1 by default)."""
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8192, help="samples per rank")
    p.add_argument("--ids-per-bag", type=int, default=20)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    p.add_argument("--profile", action="store_true", help="print rank 0's top kernels of each forward")
    return p.parse_args()


def build_model(args, world: int, sharding: Callable, device: torch.device):
    """An EBC of ``args.tables`` tables, table i on rank i % world under ``sharding``,
    trained by fused ``EXACT_SGD``; the same weights whatever the sharding."""
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = PgasEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01}
    )
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={t.name: sharding(i % world, compute_kernel="fused") for i, t in enumerate(tables)},
        world_size=world,
        local_size=world,
        device_type="cuda",
        sharder=sharder,
    )
    dmp = DistributedModelParallel(
        _Holder(ebc), device=device, plan=ShardingPlan({"ebc": plan}), sharders=[sharder],
        init_data_parallel=False,
    )
    # Same weights in both models: each table drawn from one seed, sliced per shard.
    for key, value in dmp.state_dict().items():
        for shard in value.local_shards():
            table = int(key.split("embedding_bags.t")[1].split(".")[0])
            g = torch.Generator(device=device).manual_seed(table)
            full = torch.rand(args.rows, args.dim, generator=g, device=device) * 0.02 - 0.01
            (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.detach().copy_(full[r : r + nr, c : c + nc])
    return dmp


def make_batches(args, device: torch.device, n: int) -> List[KeyedJaggedTensor]:
    """``n`` batches of ``args.batch_size`` samples, uniform ids, seeded per rank."""
    g = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    lengths = torch.full((args.tables * args.batch_size,), args.ids_per_bag, dtype=torch.int64, device=device)
    return [
        KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(args.tables)],
            values=torch.randint(0, args.rows, (int(lengths.numel() * args.ids_per_bag),), generator=g, device=device),
            lengths=lengths,
        )
        for _ in range(n)
    ]


def _time(fn: Callable[[int], None], args, label: str) -> float:
    for i in range(args.warmup):
        fn(i)
    times = []
    for i in tqdm(range(args.iters), desc=label, disable=dist.get_rank() != 0, leave=False):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    # Every rank reports the slowest rank's median: a step is as fast as its slowest rank.
    median = torch.tensor([statistics.median(times)], device=torch.device("cuda"))
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def _profile(fn: Callable[[int], None], name: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    for i in range(3):
        fn(i)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            fn(i)
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(f"\n{name}: 5 forwards")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    args = _parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    batches = make_batches(args, device, 4)
    models = {
        "table_wise": build_model(args, world, table_wise, device),
        "pgas_table_wise": build_model(args, world, pgas_table_wise, device),
    }
    grads = [torch.randn(args.batch_size, args.tables * args.dim, device=device) for _ in batches]

    with torch.no_grad():
        outs = {name: m(batches[0]).values() for name, m in models.items()}
    agree = torch.equal(outs["table_wise"], outs["pgas_table_wise"])

    results: Dict[str, Dict[str, float]] = {}
    for name, model in models.items():

        def forward(i: int, model=model) -> None:
            with torch.no_grad():
                model(batches[i % len(batches)]).values()

        def train_step(i: int, model=model) -> None:
            out = model(batches[i % len(batches)]).values()
            out.backward(grads[i % len(grads)])

        if args.profile:
            _profile(forward, name)
        results[name] = {
            "forward_ms": _time(forward, args, f"{name} forward"),
            "train_step_ms": _time(train_step, args, f"{name} train step"),
        }
    if rank == 0:
        base, ours = results["table_wise"], results["pgas_table_wise"]
        print(
            f"\n{world} x {torch.cuda.get_device_name(device)}: {args.tables} tables x {args.rows} rows x dim "
            f"{args.dim} fp32, {args.batch_size} samples per rank, {args.ids_per_bag} ids per bag, "
            f"median of {args.iters} iterations"
        )
        print(f"{'':<16}{'table_wise ms':>15}{'pgas ms':>10}{'speed-up':>10}")
        for key, label in (("forward_ms", "forward"), ("train_step_ms", "training step")):
            print(f"{label:<16}{base[key]:>15.3f}{ours[key]:>10.3f}{base[key] / ours[key]:>9.2f}x")
        print(f"outputs identical: {agree}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "results": results, "agree": agree}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
