"""The DLRM of the example and how it is sharded: stock TorchRec, plus the opt-in.

Moving tables to PGAS is ``torchrec_pgas.register()`` (done once in ``shard``) and a
planner constraint naming the sharding type; nothing else in the example knows about
torchrec_pgas.
"""

import argparse
import contextlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import torchrec_pgas

DENSE_FEATURES = 13
SHARDINGS = ("pgas_table_wise", "pgas_row_wise", "table_wise", "row_wise", "auto")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", type=int, default=8, help="categorical features, one table each")
    p.add_argument("--rows", type=int, default=20_000, help="rows per table (ids are hashed into them)")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights")


def feature_names(args: argparse.Namespace) -> List[str]:
    return [f"cat_{i}" for i in range(args.tables)]


def build(args: argparse.Namespace, device: torch.device) -> DLRMTrain:
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f])
        for f in feature_names(args)
    ]
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=device),
            dense_in_features=DENSE_FEATURES,
            dense_arch_layer_sizes=[64, args.dim],
            over_arch_layer_sizes=[64, 1],
            dense_device=device if device.type != "meta" else None,
        )
    )


def constraints_for(sharding: str, args: argparse.Namespace) -> Dict[str, ParameterConstraints]:
    """The opt-in: every table constrained to ``sharding`` (none for ``auto``)."""
    if sharding == "auto":
        return {}
    return {f"t_{f}": ParameterConstraints(sharding_types=[sharding]) for f in feature_names(args)}


def shard(
    args: argparse.Namespace,
    sharding: str,
    device: torch.device,
    ddp_stream: Optional[torch.cuda.Stream] = None,
) -> DistributedModelParallel:
    """The DLRM sharded with ``sharding``, embedding tables trained by a fused
    row-wise Adagrad (applied in backward, as TorchRec recommends). The dense layers'
    ``DistributedDataParallel`` is built on ``ddp_stream`` if given: torch's recipe for
    capturing DDP in a CUDA graph builds it on a side stream."""
    if sharding == "row_wise" and device.type != "cuda":
        # TorchRec's sharder offers row_wise for GPUs only; its planner would fail later
        # with a message about the constraint.
        raise SystemExit("TorchRec's row_wise runs on GPUs only; on CPU use --sharding pgas_row_wise")
    torchrec_pgas.register()
    torch.manual_seed(args.seed)  # the same initial weights on every rank and every run
    model = build(args, torch.device("meta"))
    ebc = model.model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": args.lr})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device=device.type),
        constraints=constraints_for(sharding, args),
    )
    plan = planner.collective_plan(model, pg=dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, init_data_parallel=False)
    with torch.cuda.stream(ddp_stream) if ddp_stream is not None else contextlib.nullcontext():
        dmp.init_data_parallel()
    # DMP moves the modules that have parameters; the DLRM's interaction indices (a
    # buffer) would stay on the CPU, copied to the GPU at every step (which a CUDA
    # graph cannot capture).
    dmp.module.model.inter_arch.to(device)
    return dmp
