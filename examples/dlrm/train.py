"""Trains TorchRec's DLRM with the embedding tables sharded by ``--sharding``.

    torchrun --standalone --nproc_per_node=2 examples/dlrm/train.py \\
        --sharding pgas_table_wise --steps 200 --checkpoint /tmp/dlrm_ckpt

Stock TorchRec throughout: ``TrainPipelineSparseDist``, a fused row-wise Adagrad for the
tables, Adagrad for the dense layers, AUROC from torchmetrics on held-out batches and a
``torch.distributed.checkpoint`` checkpoint (``--checkpoint`` to save, ``--resume`` to
start from one, whatever sharding it was saved under). ``--data`` takes a Criteo TSV
file (``make_criteo_sample.py`` writes a small one); random data otherwise.
"""

import argparse
import itertools
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchmetrics
from data import criteo_batches, random_batches
from model import SHARDINGS, add_model_args, feature_names, shard
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from tqdm import tqdm

from torchrec_pgas.process import finish, start_rank


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sharding", choices=SHARDINGS, default="pgas_table_wise")
    p.add_argument("--data", default="random", help="'random' or the path of a Criteo TSV file")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank")
    p.add_argument("--checkpoint", default=None, help="directory to save the trained model to")
    p.add_argument("--resume", default=None, help="checkpoint directory to start from")
    add_model_args(p)
    return p.parse_args()


def batches(args: argparse.Namespace, held_out: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.data == "random":
        return random_batches(feature_names(args), args.batch_size, args.rows, 10_000 * held_out + rank)
    return criteo_batches(args.data, feature_names(args), args.batch_size, args.rows, rank, world, held_out)


def main() -> None:
    args = parse()
    device = start_rank()
    rank = dist.get_rank()
    model = shard(args, args.sharding, device)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=args.lr),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    if args.resume:
        # The weights and both optimizers' state (the fused one's is sharded like its
        # tables): a resumed run goes on where the saved one stopped.
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=args.resume)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    pipeline = TrainPipelineSparseDist(model, optimizer, device)

    train = itertools.islice(batches(args, held_out=False), args.steps)
    losses, start = [], time.perf_counter()
    for _ in tqdm(range(args.steps), desc=f"train {args.sharding}", disable=rank != 0):
        loss, _, _ = pipeline.progress(train)  # DLRMTrain: (loss, logits, labels)
        losses.append(float(loss))
    elapsed = time.perf_counter() - start

    # The pipeline has taken over the model's forward; in eval mode it runs the forward
    # alone (no backward, no optimizer step).
    auroc = torchmetrics.AUROC(task="binary").to(device)
    model.eval()
    held_out = itertools.islice(batches(args, held_out=True), args.eval_batches)
    with torch.no_grad():
        for _ in range(args.eval_batches):
            _, logits, labels = pipeline.progress(held_out)
            auroc.update(torch.sigmoid(logits), labels.int())
    score = float(auroc.compute())

    if args.checkpoint:
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=args.checkpoint)
    if rank == 0:
        rate = args.steps * args.batch_size * dist.get_world_size() / elapsed
        print(
            f"{args.sharding}: {args.steps} steps on {dist.get_world_size()} x {device.type}, "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, eval AUROC {score:.4f}, "
            f"{rate:,.0f} samples/s" + (f", checkpoint in {args.checkpoint}" if args.checkpoint else "")
        )
    finish()


if __name__ == "__main__":
    main()
