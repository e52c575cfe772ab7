"""Serves a trained DLRM checkpoint under several shardings side by side, and reports
latency percentiles and throughput of each (and whether their predictions agree).

    torchrun --standalone --nproc_per_node=2 examples/dlrm/infer.py \\
        --checkpoint /tmp/dlrm_ckpt --shardings pgas_table_wise,table_wise

The checkpoint may have been saved under any sharding: each model loads it through
``torch.distributed.checkpoint``, which reshards.
"""

import argparse
import itertools
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from data import random_batches
from model import SHARDINGS, add_model_args, feature_names, shard
from tqdm import tqdm

from torchrec_pgas.process import finish, start_rank


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--shardings", default="pgas_table_wise,table_wise")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank")
    add_model_args(p)
    return p.parse_args()


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
            for i, batch in enumerate(
                tqdm([*requests[: args.warmup], *requests], desc=f"serve {sharding}", disable=rank != 0)
            ):
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                _, (_, logits, _) = model(batch)
                _sync(device)
                if i >= args.warmup:
                    times.append((time.perf_counter() - start) * 1e3)
                    preds.append(torch.sigmoid(logits))
        latencies[sharding], predictions[sharding] = times, preds

    if rank == 0:
        print(f"\nDLRM inference, {world} x {device.type}, {args.batch_size} samples per rank, {args.batches} batches")
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
    finish()


if __name__ == "__main__":
    main()
