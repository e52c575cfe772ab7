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

``--cuda-graph`` (GPUs only) also times our side's forward, DLRM inference and
training step captured in a CUDA graph (``torchrec_pgas.graphs.capture``) and
replayed, each replay with its batch copied into the graph's inputs, timed as the
eager steps are; the report puts them next to our eager times and TorchRec's, with
TorchRec's eager time over ours graphed, and the largest difference of a replay's
outputs from the eager step's on the same batch and weights. TorchRec's sharding is
eager only (``TORCHREC_NOT_GRAPHED`` says why).

``--sparse-update fbgemm`` builds our side with FBGEMM's backward for its training steps
(``PgasOptions.sparse_update``; one read-back per step, not capturable) instead of our
fused update, to compare the two against TorchRec's in separate runs. ``--remote-path put``
builds it with NVSHMEM puts to every peer (``PgasOptions.remote_path``: the path between
nodes) instead of stores through peer mappings, to measure that path inside a node.
``--headroom`` sizes our buffers at that many times the first batch
(``PgasOptions.headroom``, default 2): the fused update sorts the index tensor's whole
capacity, so 1 shows what the headroom costs a training step. Each row records our
side's options (``options``).
"""

import argparse
import gc
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from torchrec_pgas.benchmark import floor, report, timing, workload
from torchrec_pgas.benchmark.config import (
    CPU_SCALE,
    DEFAULT_SCALE,
    Config,
    add_config_args,
    add_options_args,
    base_config,
    batch_sweep,
    options_record,
    pgas_options,
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


#: Why TorchRec's side has no graphed times (``--cuda-graph``).
TORCHREC_NOT_GRAPHED = (
    "n/a: its input dist reads the all-to-all's split sizes back to the host "
    "(SplitsAllToAllAwaitable), which a CUDA graph cannot capture"
)


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
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
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="GPUs only: also time our forward, DLRM inference and training step captured in a CUDA graph "
        "and replayed, next to the eager times (TorchRec's sharding cannot be captured)",
    )
    add_options_args(p)
    p.add_argument("--out", default="benchmark_results")
    args = p.parse_args(argv)
    if args.cuda_graph and not torch.cuda.is_available():
        p.error("--cuda-graph needs GPUs (it captures CUDA graphs), and torch sees no CUDA device here")
    return args


def _pairs(cfg: Config, device: torch.device) -> List[Tuple[str, str]]:
    """The (TorchRec, ours) pairs ``device`` offers for ``cfg``."""
    offered = set(PgasEmbeddingBagCollectionSharder().sharding_types(device.type))
    if cfg.shape == "dlrm":
        return [MIXED_PAIR if "row_wise" in offered else MIXED_FALLBACK]
    return [pair for pair in PAIRS if set(pair) <= offered]


class Measured(NamedTuple):
    """One side's measurements on one configuration."""

    #: Median ms per measurement (``report.METRICS``; with ``--cuda-graph``, ours
    #: also under ``report.graphed`` keys).
    times: Dict[str, float]
    #: The first embedding output, [batch, tables, dim] in table order.
    first: torch.Tensor
    #: The largest difference, over the ranks, of a graphed output from the eager one
    #: on the same batch and weights (0 where nothing was graphed).
    graphed_diff: float


def _measure(cfg: Config, sharding: str, device: torch.device, pg, args, graphed: bool = False) -> Measured:
    """Times of ``sharding`` on ``cfg``: eager, and with ``graphed`` captured in CUDA
    graphs too. Each model takes its eager steps before any capture: a captured
    model takes no more eager steps."""
    rank = dist.get_rank(pg)
    kjts = workload.batches(cfg, device, 4, rank)
    dense = workload.dense_features(cfg, device, 4, rank)
    grads = [torch.randn(cfg.batch_size, len(kjts[0].keys()) * cfg.dim, device=device) for _ in kjts]
    options = pgas_options(args)
    model = workload.build(cfg, sharding, device, pg, options=options)
    with torch.no_grad():
        first = workload.pooled_by_table(model, kjts[0])
    forward, train_step = workload.step_fns(model)
    batches, trains = [(kjt,) for kjt in kjts], list(zip(kjts, grads))
    times = {
        "forward_ms": _median(forward, batches, device, pg, args),
        "train_ms": _median(train_step, trains, device, pg, args),
    }
    diffs = [0.0]
    if graphed:
        times[report.graphed("forward_ms")], diff = _graphed(forward, batches, model, device, pg, args, compare=True)
        diffs.append(diff)
        # Last on this model: its replays train the tables.
        times[report.graphed("train_ms")], _ = _graphed(train_step, trains, model, device, pg, args, compare=False)
    del model, forward, train_step
    gc.collect()  # the EBC's model (and its graphs) go before the DLRM's is built
    model = workload.build(cfg, sharding, device, pg, dlrm=True, options=options)
    infer, inputs = workload.dlrm_inference(model), list(zip(dense, kjts))
    times["dlrm_ms"] = _median(infer, inputs, device, pg, args)
    if graphed:
        times[report.graphed("dlrm_ms")], diff = _graphed(infer, inputs, model, device, pg, args, compare=True)
        diffs.append(diff)
    del model, infer
    gc.collect()  # the models' buffers go back before the next configuration
    return Measured(times, first, max(diffs))


def _median(step: Callable[..., torch.Tensor], inputs: List[Tuple[Any, ...]], device: torch.device, pg, args) -> float:
    """The median ms of ``step`` on ``inputs`` (cycling), slowest rank (``timing.median_ms``)."""
    return timing.median_ms(workload.cycle(step, inputs), args.iters, args.warmup, device, pg)


def _graphed(
    step: Callable[..., torch.Tensor],
    inputs: List[Tuple[Any, ...]],
    model: torch.nn.Module,
    device: torch.device,
    pg,
    args,
    compare: bool,
) -> Tuple[float, float]:
    """``step`` of ``model`` captured in a CUDA graph (on ``inputs[0]``), then timed as
    the eager steps are, each replay with its inputs copied in; and with ``compare``
    (for steps that leave the weights alone) the largest difference over the ranks of
    the replay's output on ``inputs[1]`` from the eager step's, else 0. A replay's bad
    batch is raised after it (``graphs.raise_errors``): the replays end with a wait for
    the last ones."""
    from torchrec_pgas.graphs import capture, raise_errors  # GPUs only: CPU runs never import it

    reference = step(*inputs[1]).clone() if compare else None
    captured = capture(step, *inputs[0], model=model)
    diff = torch.zeros((), device=device)
    if reference is not None:
        diff = (captured(*inputs[1]) - reference).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=pg)
    ms = _median(captured, inputs, device, pg, args)
    raise_errors(model, wait=True)
    return ms, float(diff)


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
        # Ours only is graphed: TorchRec's sharding cannot be captured (TORCHREC_NOT_GRAPHED).
        rounds = [
            [_measure(cfg, s, device, pg, args, graphed=args.cuda_graph and s == pair[1]) for s in pair]
            for _ in range(args.rounds)
        ]
        base_out, ours_out = (m.first for m in rounds[-1])
        # Per placement: where both sides place a table the same way, outputs must be
        # bit for bit identical; TorchRec's table-wise against our row-wise (CPUs) sums
        # partial sums in another order.
        row_wise = torch.tensor([s.row_wise for s in table_specs(cfg)], device=device)
        error = (base_out - ours_out).abs().amax(dim=(0, 2))
        diffs = torch.stack([error.max(), error.where(~row_wise, 0).max(), error.where(row_wise, 0).max()])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=pg)
        diff = diffs[0]
        row = {
            "scenario": name,
            "label": cfg.label(),
            "short": _short(name, cfg, bool(args.batch_sizes)),
            "config": vars(cfg),
            "pair": pair,
            **report.summarize([(base.times, ours.times) for base, ours in rounds]),
            "identical": bool(diff == 0),
            "max_diff": float(diff),
            "max_diff_by_placement": {"table_wise": float(diffs[1]), "row_wise": float(diffs[2])},
            "floor_ms": parts.floor_ms,
            "memory_ms": parts.memory_ms,
            "link_ms": parts.link_ms,
            "copy_gbps": copy,
            "link_gbps": link,
            "options": options_record(pgas_options(args)),  # our side's
            "wall_s": time.perf_counter() - begin,
        }
        if args.cuda_graph:
            row["baseline_graphed"] = TORCHREC_NOT_GRAPHED
            row["graphed_max_diff"] = max(ours.graphed_diff for _, ours in rounds)
        rows.append(row)
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
