"""PGAS sharding against TorchRec's own (FBGEMM FUSED; NCCL on GPUs, gloo on CPUs),
side by side in one process group, on the same weights and batches.

    torchrun --standalone --nproc_per_node=2 -m torchrec_pgas.benchmark               # R1
    torchrun --standalone --nproc_per_node=2 -m torchrec_pgas.benchmark --suite all --out bench

For every configuration of the chosen scenarios (``config.scenarios``) and every pair
(``table_wise`` / ``pgas_table_wise``, and ``row_wise`` / ``pgas_row_wise`` where the
device offers both) it measures, median of ``--iters`` after ``--warmup`` (CUDA events
on GPUs): the embedding forward (inference), a DLRM inference pass, and a training step
(forward, backward, fused optimizer); it checks that the outputs agree, and puts the
forward against the hardware floor (``floor``: its memory and link parts, and their
maximum). Configurations on fewer ranks than
launched run on a subgroup. Results: ``OUT/results.json``, ``OUT/results.md`` and
``OUT/speedup.png``.

The ``dlrm`` scenario (``config.table_specs``) has one pair, each side one module:
``pgas_table_wise+pgas_row_wise`` against TorchRec's ``table_wise+row_wise`` (the big
tables row-wise, the rest table-wise). TorchRec offers ``row_wise`` on GPUs only: on
CPUs ours is compared with TorchRec's ``table_wise`` for every table (said on rank 0
and in the pair's name). ``--batch-sizes 512,...,65536`` runs every chosen scenario at
each batch size (the plot then has the speed-up against samples per rank):

    torchrun --standalone --nproc_per_node=2 -m torchrec_pgas.benchmark --suite r1,dlrm \\
        --batch-sizes 512,1024,2048,4096,8192,16384,32768,65536 --out bench_sweep
"""

import argparse
import gc
import statistics
import sys
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from torchrec_pgas.benchmark import floor, report, timing, workload
from torchrec_pgas.benchmark.config import (
    CPU_SCALE,
    DEFAULT_SCALE,
    Config,
    add_config_args,
    base_config,
    batch_sweep,
    scenarios,
    table_specs,
)
from torchrec_pgas.process import finish, start_rank
from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder

PAIRS = (("table_wise", "pgas_table_wise"), ("row_wise", "pgas_row_wise"))
#: The DLRM scenario's pair (small tables table-wise + big ones row-wise, one module
#: each side), and TorchRec's side where it does not offer row-wise (CPUs).
MIXED_PAIR = ("table_wise+row_wise", "pgas_table_wise+pgas_row_wise")
MIXED_FALLBACK = ("table_wise", "pgas_table_wise+pgas_row_wise")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--suite", default="r1", help="comma-separated scenarios, or 'all'")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure TorchRec's sharding and ours this many times each, alternating; "
        "report the median of the rounds' medians and the rounds' speed-ups",
    )
    p.add_argument("--out", default="benchmark_results")
    return p.parse_args()


def _pairs(cfg: Config, device: torch.device) -> List[Tuple[str, str]]:
    """The (TorchRec, ours) pairs ``device`` offers for ``cfg``."""
    offered = set(PgasEmbeddingBagCollectionSharder().sharding_types(device.type))
    if cfg.shape == "dlrm":
        return [MIXED_PAIR if "row_wise" in offered else MIXED_FALLBACK]
    return [pair for pair in PAIRS if set(pair) <= offered]


def _measure(cfg: Config, sharding: str, device: torch.device, pg, args) -> Tuple[Dict[str, float], torch.Tensor]:
    """Times of ``sharding`` on ``cfg``, and its first embedding output ([batch,
    tables, dim], in table order)."""
    rank = dist.get_rank(pg)
    kjts = workload.batches(cfg, device, 4, rank)
    dense = workload.dense_features(cfg, device, 4, rank)
    grads = [torch.randn(cfg.batch_size, len(kjts[0].keys()) * cfg.dim, device=device) for _ in kjts]
    first, result = _time_ebc(workload.build(cfg, sharding, device, pg), kjts, grads, device, pg, args)
    result["dlrm_ms"] = _time_dlrm(workload.build(cfg, sharding, device, pg, dlrm=True), dense, kjts, device, pg, args)
    gc.collect()  # the models' buffers go back before the next configuration
    return result, first


def _time_ebc(model, kjts, grads, device, pg, args) -> Tuple[torch.Tensor, Dict[str, float]]:
    with torch.no_grad():
        first = workload.pooled_by_table(model, kjts[0])
    forward, train_step = workload.steps(model, kjts, grads)
    return first, {
        "forward_ms": timing.median_ms(forward, args.iters, args.warmup, device, pg),
        "train_ms": timing.median_ms(train_step, args.iters, args.warmup, device, pg),
    }


def _time_dlrm(model, dense, kjts, device, pg, args) -> float:
    def infer(i: int) -> None:
        with torch.no_grad():
            model(dense[i % len(dense)], kjts[i % len(kjts)])

    return timing.median_ms(infer, args.iters, args.warmup, device, pg)


def _run(
    name: str, cfg: Config, pg, device: torch.device, bandwidth: Dict[int, Tuple[float, float]], args
) -> List[Dict[str, Any]]:
    """Every pair on one configuration (on the ranks of ``pg``)."""
    if cfg.ranks not in bandwidth:  # measured once per group, in the same run
        cuda = device.type == "cuda"
        bandwidth[cfg.ranks] = (
            floor.copy_gbps(device, 1 << (28 if cuda else 24)),
            floor.link_gbps(pg, device, 1 << (26 if cuda else 24)),
        )
    copy, link = bandwidth[cfg.ranks]
    parts = floor.floor(cfg, copy, link)
    rows = []
    for pair in _pairs(cfg, device):
        begin = time.perf_counter()  # models built and timed: what a run of the pair costs
        rounds = [[_measure(cfg, s, device, pg, args) for s in pair] for _ in range(args.rounds)]
        (_, base_out), (_, ours_out) = rounds[-1]
        # Per placement: where both sides place a table the same way, outputs must be
        # bit for bit identical; TorchRec's table-wise against our row-wise (CPUs) sums
        # partial sums in another order.
        row_wise = torch.tensor([s.row_wise for s in table_specs(cfg)], device=device)
        error = (base_out - ours_out).abs().amax(dim=(0, 2))
        diffs = torch.stack([error.max(), error.where(~row_wise, 0).max(), error.where(row_wise, 0).max()])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=pg)
        diff = diffs[0]
        base, ours = ({key: statistics.median(r[i][0][key] for r in rounds) for key in rounds[0][i][0]} for i in (0, 1))
        rows.append(
            {
                "scenario": name,
                "label": cfg.label(),
                "short": _short(name, cfg, bool(args.batch_sizes)),
                "config": vars(cfg),
                "pair": pair,
                "baseline": base,
                "ours": ours,
                "identical": bool(diff == 0),
                "max_diff": float(diff),
                "max_diff_by_placement": {"table_wise": float(diffs[1]), "row_wise": float(diffs[2])},
                "floor_ms": parts.floor_ms,
                "memory_ms": parts.memory_ms,
                "link_ms": parts.link_ms,
                "copy_gbps": copy,
                "link_gbps": link,
                "wall_s": time.perf_counter() - begin,
                "speedup_per_round": {key: [r[0][0][key] / r[1][0][key] for r in rounds] for key in rounds[0][0][0]},
            }
        )
    return rows


def main() -> None:
    args = _parse()
    device = start_rank()
    cuda, rank, world = device.type == "cuda", dist.get_rank(), dist.get_world_size()
    scale = args.scale or (DEFAULT_SCALE if cuda else CPU_SCALE)
    chosen = scenarios(base_config(args, world), world, scale)
    names = list(chosen) if args.suite == "all" else args.suite.split(",")
    unknown = [n for n in names if n not in chosen]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}: expected 'all' or some of {list(chosen)}")
    if args.batch_sizes:
        chosen = {name: batch_sweep(configs, args.batch_sizes) for name, configs in chosen.items()}
    groups: Dict[int, Any] = {}
    bandwidth: Dict[int, Tuple[float, float]] = {}
    rows: List[Dict[str, Any]] = []
    work = [(name, cfg) for name in names for cfg in chosen[name]]
    if cuda:
        # NVSHMEM spans every process of a launch: the points of the scaling scenarios
        # on fewer GPUs take a launch of their own (--nproc_per_node=N).
        fewer = [f"{name} on {cfg.ranks}" for name, cfg in work if cfg.ranks != world]
        work = [(name, cfg) for name, cfg in work if cfg.ranks == world]
        if fewer and rank == 0:
            print(f"left out (launch with fewer GPUs for them): {', '.join(fewer)}", flush=True)
    if any(cfg.shape == "dlrm" for _, cfg in work) and _pairs(Config(shape="dlrm"), device) == [MIXED_FALLBACK]:
        if rank == 0:
            print(
                f"dlrm: TorchRec offers no row_wise on {device.type}: {MIXED_FALLBACK[1]} is compared "
                f"with TorchRec's {MIXED_FALLBACK[0]} for every table",
                flush=True,
            )
    hardware = f"{world} x {torch.cuda.get_device_name(device)}" if cuda else f"{world} CPU processes"
    meta = {
        "hardware": hardware,
        "host": timing.host(device),
        "iters": args.iters,
        "rounds": args.rounds,
        "command": "torchrun ... -m torchrec_pgas.benchmark " + " ".join(sys.argv[1:]),
    }
    for i, (name, cfg) in enumerate(tqdm(work, desc="configurations", disable=rank != 0)):
        if cfg.ranks not in groups:  # every rank creates every group, in order
            groups[cfg.ranks] = dist.new_group(list(range(cfg.ranks)))
        if rank < cfg.ranks:
            rows += _run(name, cfg, groups[cfg.ranks], device, bandwidth, args)
        if rank == 0:  # after every configuration: a long run cut short keeps what it measured
            report.write(rows, meta, args.out, show=i == len(work) - 1)
        dist.barrier()
    finish()


def _short(scenario: str, cfg: Config, sweep: bool = False) -> str:
    """The configuration's name on the plot's axis: its batch size in a batch sweep."""
    if sweep:
        return str(cfg.batch_size)
    return {
        "weak": f"{cfg.ranks} ranks",
        "strong": f"{cfg.ranks} ranks",
        "dim": f"dim {cfg.dim}",
        "ids_per_bag": f"{cfg.ids_per_bag} ids",
        "batch_size": f"{cfg.batch_size}",
        "zipf": "zipf 1.05",
        "large_tables": f"{cfg.tables} x {cfg.rows}",
        "dlrm": f"DLRM scale {cfg.scale:g}",
    }.get(scenario, "R1" if scenario == "r1" else scenario)


if __name__ == "__main__":
    main()
