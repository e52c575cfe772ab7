"""Trains a small DLRM on random data with ``pgas_table_wise`` and with TorchRec's own
``table_wise``, side by side in one process group, from the same weights and batches,
and prints loss and throughput of each.

    torchrun --standalone --nproc_per_node=2 examples/dlrm/demo.py

Opting in is the two marked lines: ``torchrec_pgas.register()`` and a planner
constraint naming the sharding type; everything else is stock TorchRec.
"""

import argparse
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from tqdm import tqdm

import torchrec_pgas
from torchrec_pgas.testing import load_unsharded_state_dict

DENSE_FEATURES = 13


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--ids-per-feature", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args()


def _model(args: argparse.Namespace, device: torch.device) -> Tuple[DLRMTrain, List[str]]:
    tables = [
        EmbeddingBagConfig(
            name=f"t_cat_{i}",
            embedding_dim=args.dim,
            num_embeddings=args.rows,
            feature_names=[f"cat_{i}"],
        )
        for i in range(args.tables)
    ]
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=device),
            dense_in_features=DENSE_FEATURES,
            dense_arch_layer_sizes=[64, args.dim],
            over_arch_layer_sizes=[64, 1],
            dense_device=device,
        )
    )
    return model, [t.name for t in tables]


def _train(
    sharding_type: str,
    args: argparse.Namespace,
    init: Dict[str, torch.Tensor],
    device: torch.device,
) -> Tuple[List[float], float]:
    model, table_names = _model(args, torch.device("meta"))
    ebc = model.model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": args.lr})
    # Opting in: a constraint naming the sharding type (after torchrec_pgas.register()).
    constraints = {t: ParameterConstraints(sharding_types=[sharding_type]) for t in table_names}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device=device.type),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, pg=dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan)  # sharders=None
    load_unsharded_state_dict(dmp, init)
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    optimizer = torch.optim.SGD(dense, lr=args.lr)

    batches = iter(
        RandomRecDataset(
            keys=[f"cat_{i}" for i in range(args.tables)],
            batch_size=args.batch_size,
            hash_size=args.rows,
            ids_per_feature=args.ids_per_feature,
            num_dense=DENSE_FEATURES,
            manual_seed=1000 + dist.get_rank(),
        )
    )
    losses = []
    start = 0.0
    steps = tqdm(range(args.steps), desc=sharding_type, disable=dist.get_rank() != 0)
    for step in steps:
        if step == 2:  # leave the first steps (allocation, warm-up) out of the timing
            start = time.perf_counter()
        batch = next(batches).to(device)
        loss, _ = dmp(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        steps.set_postfix(loss=f"{losses[-1]:.4f}")
    elapsed = time.perf_counter() - start
    samples = (args.steps - 2) * args.batch_size * dist.get_world_size()
    return losses, samples / elapsed


def main() -> None:
    args = _parse()
    device = torch.device("cpu")
    dist.init_process_group("gloo")
    torchrec_pgas.register()  # Opting in, part one.
    if dist.get_rank() == 0 and torch.cuda.is_available():
        print("note: the GPU (NVSHMEM) path is not in this build; running on CPU processes")

    torch.manual_seed(0)
    unsharded, _ = _model(args, device)
    init = {k: v.detach().clone() for k, v in unsharded.state_dict().items()}

    results = {}
    for sharding_type in ("table_wise", "pgas_table_wise"):
        results[sharding_type] = _train(sharding_type, args, init, device)
    if dist.get_rank() == 0:
        base_losses, base_rate = results["table_wise"]
        print(
            f"\nDLRM, {dist.get_world_size()} CPU ranks, {args.tables} tables x {args.rows} rows "
            f"x dim {args.dim}, {args.batch_size} samples per rank, {args.steps} steps"
        )
        print(f"{'sharding':<18}{'first loss':>12}{'last loss':>12}{'samples/s':>12}{'speed-up':>10}")
        for name, (losses, rate) in results.items():
            print(f"{name:<18}{losses[0]:>12.6f}{losses[-1]:>12.6f}{rate:>12.0f}{rate / base_rate:>9.2f}x")
        same = results["pgas_table_wise"][0] == base_losses
        print(f"losses identical at every step: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
