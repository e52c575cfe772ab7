"""Serves a trained DLRM checkpoint under several shardings side by side, and reports
latency percentiles and throughput of each (and whether their predictions agree).

    torchrun --standalone --nproc_per_node=2 examples/dlrm/infer.py \\
        --checkpoint /tmp/dlrm_ckpt --shardings pgas_table_wise,table_wise

The checkpoint may have been saved under any sharding: each model loads it through
``torch.distributed.checkpoint``, which reshards.

``--quant int8|int4|fp16`` also quantizes the checkpoint's model with TorchRec's
``quantize_embeddings`` and serves it ``pgas_table_wise`` (on the ranks' CPUs or
GPUs), printing the AUROC of the float and the quantized model on the same requests.

``--cuda-graph`` (GPU ranks) serves the PGAS shardings from a CUDA graph of the whole
forward (dense and sparse) captured on the first request, replayed for every request;
TorchRec's own shardings, whose all-to-alls read sizes back to the host, are served
eagerly beside them.
"""

import argparse
import copy
import itertools
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from data import random_batches
from model import SHARDINGS, add_model_args, build, feature_names, shard
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from torchrec_pgas import capture, raise_errors
from torchrec_pgas.process import finish, start_rank


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--shardings", default="pgas_table_wise,table_wise")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank")
    p.add_argument("--quant", choices=sorted(QUANT_DTYPES), help="also serve the model quantized, pgas_table_wise")
    p.add_argument("--cuda-graph", action="store_true", help="serve the PGAS shardings from a CUDA graph (GPU ranks)")
    add_model_args(p)
    return p.parse_args()


QUANT_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.half}


def serve_quantized(args: argparse.Namespace, requests: List[Batch], device: torch.device) -> None:
    """Loads the checkpoint into the unsharded float model on ``device``, quantizes its
    tables with TorchRec's API, shards them ``pgas_table_wise`` and prints both models'
    AUROC."""
    from torchrec.inference.modules import quantize_embeddings

    from torchrec_pgas.quant import shard_quant_model

    model = build(args, device)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=args.checkpoint)
    model.load_state_dict(state["model"])
    model.eval()
    float_model = copy.deepcopy(model)
    quantize_embeddings(model, dtype=QUANT_DTYPES[args.quant], inplace=True)
    shard_quant_model(model, dist.group.WORLD)
    preds: Dict[str, List[torch.Tensor]] = {"float": [], args.quant: []}
    with torch.no_grad():
        for batch in tqdm(requests, desc=f"serve {args.quant}", disable=dist.get_rank() != 0):
            preds["float"].append(torch.sigmoid(float_model(batch)[1][1]))
            preds[args.quant].append(torch.sigmoid(model(batch)[1][1]))
    raise_errors(model, wait=True)  # GPUs: what the last steps reported
    labels = torch.cat([b.labels for b in requests]).cpu()
    mine = {k: torch.cat(v).cpu() for k, v in preds.items()}
    everyone: List = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, labels))
    if dist.get_rank() == 0:
        import torchmetrics

        all_labels = torch.cat([lab for _, lab in everyone]).int()
        gap = max(float((p["float"] - p[args.quant]).abs().max()) for p, _ in everyone)
        for kind in preds:
            auroc = torchmetrics.AUROC(task="binary")(torch.cat([p[kind] for p, _ in everyone]), all_labels)
            print(f"AUROC {kind}: {float(auroc):.4f}")
        print(f"predictions of float and {args.quant} (pgas_table_wise) differ by at most {gap:.2e}")


def graphed_forward(model: torch.nn.Module, like: Batch) -> Callable[[Batch], torch.Tensor]:
    """The model's logits, replayed from a CUDA graph captured on ``like`` (under the
    caller's ``no_grad``). The capture's warm-up serves ``like`` three times, and every
    rank captures here, at the same step. Requests must have ``like``'s shape: smaller
    ones are padded to it (``pad_like``)."""

    def logits(dense: torch.Tensor, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        return model(Batch(dense_features=dense, sparse_features=kjt, labels=labels))[1][1]

    step = capture(logits, like.dense_features, like.sparse_features, like.labels, model=model)

    def forward(batch: Batch) -> torch.Tensor:
        padded = pad_like(batch, like)
        return step(padded.dense_features, padded.sparse_features, padded.labels)[: batch.labels.numel()]

    return forward


def pad_like(batch: Batch, like: Batch) -> Batch:
    """``batch`` in ``like``'s shape, for a graph captured on ``like``: empty samples
    appended, and the ids it lacks (id 0) in the last one's last bag; their predictions
    are dropped. A request with as many samples but fewer ids, or more samples or ids,
    cannot be padded: refused."""
    kjt, full = batch.sparse_features, like.sparse_features
    n, size = batch.labels.numel(), like.labels.numel()
    spare = full.values().numel() - kjt.values().numel()
    if n == size and spare == 0:
        return batch
    if n >= size or spare < 0 or kjt.keys() != full.keys() or kjt.weights_or_none() is not None:
        raise SystemExit(
            f"--cuda-graph: a request of {n} samples and {kjt.values().numel()} ids does not fit the captured "
            f"shape ({size} samples, {full.values().numel()} ids)"
        )
    keys, lengths = kjt.keys(), kjt.lengths()
    padding = lengths.new_zeros(len(keys), size - n)
    padding[-1, -1] = spare
    dense = batch.dense_features
    return Batch(
        dense_features=torch.cat([dense, dense.new_zeros(size - n, dense.shape[1])]),
        sparse_features=KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([kjt.values(), kjt.values().new_zeros(spare)]),
            lengths=torch.cat([lengths.view(len(keys), n), padding], dim=1).flatten(),
        ),
        labels=torch.cat([batch.labels, batch.labels.new_zeros(size - n)]),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse()
    shardings = args.shardings.split(",")
    for s in shardings:
        if s not in SHARDINGS:
            raise SystemExit(f"unknown sharding {s!r}; choose from {', '.join(SHARDINGS)}")
    device = start_rank()
    if args.cuda_graph and device.type != "cuda":
        raise SystemExit(f"--cuda-graph needs GPU ranks (CUDA graphs); this run's are {device.type}")
    rank, world = dist.get_rank(), dist.get_world_size()
    requests = [
        b.to(device)
        for b in itertools.islice(
            random_batches(feature_names(args), args.batch_size, args.rows, 77 + rank), args.batches
        )
    ]

    latencies: Dict[str, List[float]] = {}
    predictions: Dict[str, List[torch.Tensor]] = {}
    for sharding in shardings:
        model = shard(args, sharding, device)
        state = {"model": model.state_dict()}  # the weights; the optimizers' state stays
        dcp.load(state, checkpoint_id=args.checkpoint)
        model.load_state_dict(state["model"])
        model.eval()
        times, preds = [], []
        with torch.no_grad():
            graphed = args.cuda_graph and sharding.startswith("pgas_")
            forward = graphed_forward(model, requests[0]) if graphed else lambda b: model(b)[1][1]
            for i, batch in enumerate(
                tqdm([*requests[: args.warmup], *requests], desc=f"serve {sharding}", disable=rank != 0)
            ):
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                logits = forward(batch)
                _sync(device)
                if i >= args.warmup:
                    times.append((time.perf_counter() - start) * 1e3)
                    preds.append(torch.sigmoid(logits))
            if graphed:
                raise_errors(model, wait=True)  # what the last replays reported
        latencies[sharding], predictions[sharding] = times, preds

    if rank == 0:
        print(f"\nDLRM inference, {world} x {device.type}, {args.batch_size} samples per rank, {args.batches} batches")
        if args.cuda_graph:
            names = ", ".join(s for s in shardings if s.startswith("pgas_")) or "none"
            print(f"served from CUDA graphs: {names} (TorchRec's shardings eagerly)")
        print(f"{'sharding':<18}{'p50 ms':>9}{'p99 ms':>9}{'samples/s':>12}")
        for sharding, times in latencies.items():
            p99 = statistics.quantiles(times, n=100)[98] if len(times) > 1 else times[0]
            rate = args.batch_size * world * len(times) / (sum(times) / 1e3)
            print(f"{sharding:<18}{statistics.median(times):>9.3f}{p99:>9.3f}{rate:>12,.0f}")
        first = predictions[shardings[0]]
        for other in shardings[1:]:
            # Table-wise shardings pool the same way and agree bit for bit; row-wise
            # ones add partial sums, so they agree up to float rounding.
            diff = max(float((a - b).abs().max()) for a, b in zip(first, predictions[other]))
            verdict = "identical" if diff == 0 else f"differ by at most {diff:.2e}"
            print(f"predictions of {shardings[0]} and {other}: {verdict}")
    if args.quant:
        serve_quantized(args, requests, device)
    finish()


if __name__ == "__main__":
    main()
