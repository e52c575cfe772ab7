"""Trains TorchRec's DLRM with the embedding tables sharded by ``--sharding``.

    torchrun --standalone --nproc_per_node=2 examples/dlrm/train.py \\
        --sharding pgas_table_wise --steps 200 --checkpoint /tmp/dlrm_ckpt

Stock TorchRec throughout: ``TrainPipelineSparseDist``, a fused row-wise Adagrad for the
tables, Adagrad for the dense layers, AUROC from torchmetrics on held-out batches and a
``torch.distributed.checkpoint`` checkpoint (``--checkpoint`` to save, ``--resume`` to
start from one, whatever sharding it was saved under). ``--data`` takes a Criteo TSV
file (``make_criteo_sample.py`` writes a small one); random data otherwise.

``--cuda-graph`` (GPU ranks, random data: a graph replays batches of one shape) trains
with the whole step (forward, backward with the fused table optimizer, the dense
optimizer's step) replayed from a CUDA graph instead of the pipeline.
"""

import argparse
import itertools
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchmetrics
from data import criteo_batches, random_batches
from model import SHARDINGS, add_model_args, feature_names, shard
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from torchrec_pgas import capture, raise_errors
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
    p.add_argument("--cuda-graph", action="store_true", help="replay the training step from a CUDA graph (GPU ranks)")
    add_model_args(p)
    return p.parse_args()


def batches(args: argparse.Namespace, held_out: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.data == "random":
        return random_batches(feature_names(args), args.batch_size, args.rows, 10_000 * held_out + rank)
    return criteo_batches(args.data, feature_names(args), args.batch_size, args.rows, rank, world, held_out)


def graphed_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, like: Batch
) -> Callable[[Batch], torch.Tensor]:
    """The training step, replayed from a CUDA graph captured on ``like``; returns a
    batch's loss. Every rank captures here, at the same step. The capture's warm-up
    trains on ``like`` eleven times: the dense layers are under DistributedDataParallel
    (DMP's), whose first iterations set its buckets up (torch's recipe for DDP in CUDA
    graphs asks for 11).

    The dense Adagrad replays exactly: with ``lr_decay`` 0 its update reads only device
    tensors (its step count, kept on the host, stays at the warm-up's)."""

    def step(dense: torch.Tensor, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        # TorchRec's wrapper of the dense optimizer sets the gradients to None: captured,
        # the backward then writes them afresh into the graph's memory at every replay.
        optimizer.zero_grad()
        loss, _ = model(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
        loss.backward()
        optimizer.step()
        return loss.detach()

    captured = capture(step, like.dense_features, like.sparse_features, like.labels, warmup=11, model=model)
    return lambda batch: captured(batch.dense_features, batch.sparse_features, batch.labels).clone()


def main() -> None:
    args = parse()
    if args.cuda_graph:
        # torch's recipe for DDP in a CUDA graph: no asynchronous NCCL error handling
        # (read when the process group starts).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    device = start_rank()
    if args.cuda_graph and device.type != "cuda":
        raise SystemExit(f"--cuda-graph needs GPU ranks (CUDA graphs); this run's are {device.type}")
    if args.cuda_graph and args.data != "random":
        raise SystemExit("--cuda-graph replays batches of one shape: use --data random (Criteo's vary in ids)")
    if args.cuda_graph and not args.sharding.startswith("pgas_"):
        raise SystemExit(
            "--cuda-graph: TorchRec's own shardings cannot be captured (their all-to-alls read sizes back "
            "to the host): use --sharding pgas_table_wise or pgas_row_wise"
        )
    rank = dist.get_rank()
    model = shard(args, args.sharding, device, ddp_stream=torch.cuda.Stream() if args.cuda_graph else None)
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
    if args.cuda_graph:
        first = next(train).to(device)
        train = itertools.chain([first], train)
        graphed = graphed_step(model, optimizer, first)
    losses, start = [], time.perf_counter()
    for _ in tqdm(range(args.steps), desc=f"train {args.sharding}", disable=rank != 0):
        if args.cuda_graph:
            losses.append(graphed(next(train)))  # read once training is done: no wait per step
            continue
        loss, _, _ = pipeline.progress(train)  # DLRMTrain: (loss, logits, labels)
        losses.append(float(loss))
    if args.cuda_graph:
        raise_errors(model, wait=True)  # waits for the last steps, and raises what they reported
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
            f"loss {float(losses[0]):.4f} -> {float(losses[-1]):.4f}, eval AUROC {score:.4f}, "
            f"{rate:,.0f} samples/s" + (f", checkpoint in {args.checkpoint}" if args.checkpoint else "")
        )
    finish()


if __name__ == "__main__":
    main()
