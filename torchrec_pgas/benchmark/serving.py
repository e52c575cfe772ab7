"""Quantized serving: ``torchrec_pgas.quant`` (``pgas_table_wise``, one process per
GPU) against TorchRec's serving path, on the same quantized tables and batches.

    torchrun --standalone --nproc_per_node=1 -m torchrec_pgas.benchmark.serving \\
        --batch-sizes 256,1024,8192 --quant int8

The tables are R1's by default (8 x 1M rows x 128 dims, 20 ids per bag, uniform ids;
``config.add_config_args``), drawn as ``workload.build`` draws them and quantized by
TorchRec's ``quantize_embeddings``. At every batch size (samples per rank) it times,
p50 and p99 of ``--iters`` steps after ``--warmup`` (CUDA events on GPUs; a step is
as slow as its slowest rank; at world size 1 each of ours is timed interleaved with
TorchRec's counterpart, step by step, so that the host's drift falls on both alike):

* ``pgas eager``: ``torchrec_pgas.quant.shard_quant_model``, tables placed as R1
  places them (table ``i`` on rank ``i % world``);
* ``pgas graphed``: the same model's step captured by ``torchrec_pgas.graphs.capture``
  and replayed (GPUs);
* ``torchrec quant``: TorchRec's ``torchrec.inference.modules.shard_quant_model``
  (``ShardedQuantEmbeddingBagCollection``, table-wise), the path where one process
  drives every GPU: run by rank 0 alone on the global batch (``world`` times the
  per-rank batch), over GPUs 0 to ``world - 1`` (one at world size 1);
* ``torchrec quant graphed``: the same captured in a CUDA graph (``torchrec_graph``),
  as a TorchRec user captures it: the batch's per-feature id counts given with it
  (``KeyedJaggedTensor(length_per_key=...)``), known on the host for batches of a fixed
  shape, so that TorchRec's split of the batch by rank does not read them back (a copy
  to the host, which a graph cannot record); or n/a with the reason the capture gave;
* ``float table_wise``: the float tables under ``DistributedModelParallel`` with
  TorchRec's ``table_wise`` (``--no-float`` leaves it out).

It checks that ours and TorchRec's quantized outputs agree on the same batch (world
size 1: the same batch; they run the same FBGEMM kernel on the same rows), and each
graphed path against its eager one. Every path cycles through the same ``BATCHES``
KeyedJaggedTensors: a KJT keeps the per-feature id counts once computed, so TorchRec's
eager split reads them back at each batch's first use only (warm-up), where a new KJT
per request would read them at every step. Results:
a table on rank 0's stdout with each path's p50 over ours eager, and
``OUT/serving.md``, ``OUT/serving.json``, ``OUT/serving.png``.
"""

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from tqdm import tqdm

from torchrec_pgas.benchmark import timing, workload
from torchrec_pgas.benchmark.config import Config, add_config_args, base_config, batch_sweep, table_specs

DEFAULT_BATCH_SIZES = (256, 1024, 8192)
QUANT_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.half}
#: The paths timed, in the report's order; the first is what the others are put against.
PATHS = ("pgas eager", "pgas graphed", "torchrec quant", "torchrec quant graphed", "float table_wise")
#: Distinct batches each path cycles through.
BATCHES = 4


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--quant", choices=sorted(QUANT_DTYPES), default="int8", help="the tables' quantized dtype")
    p.add_argument("--iters", type=int, default=100, help="timed steps per path and batch size")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--no-float", action="store_true", help="leave out the float table_wise model (DMP)")
    p.add_argument("--out", default="serving_results")
    args = p.parse_args(argv)
    args.batch_sizes = list(args.batch_sizes or DEFAULT_BATCH_SIZES)
    if any(b <= 0 for b in args.batch_sizes):
        p.error(f"batch sizes must be positive, got {args.batch_sizes}")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters must be at least 1 and --warmup at least 0, got {args.iters} and {args.warmup}")
    return args


# ------------------------------------------------------------------ the models


def float_tables(cfg: Config, device: torch.device) -> EmbeddingBagCollection:
    """``cfg``'s tables in fp32 on ``device``, each drawn from its seed as
    ``workload.build`` draws them (so the float model's weights are these)."""
    ebc = EmbeddingBagCollection(tables=workload.embedding_configs(cfg), device=device)
    specs = table_specs(cfg)
    with torch.no_grad():
        for i, spec in enumerate(specs):
            g = torch.Generator(device=device).manual_seed(i)
            weight = ebc.embedding_bags[f"t{i}"].weight
            weight.copy_(torch.rand(spec.rows, cfg.dim, generator=g, device=device) * 0.02 - 0.01)
    return ebc


def quantized(ebc: EmbeddingBagCollection, dtype: str) -> nn.Module:
    """A module whose forward is the pooled rows ([batch, sum of dims]) of ``ebc``'s
    tables quantized to ``dtype`` by TorchRec (a new module each call; ``ebc`` is
    left as it is)."""
    from torchrec.inference.modules import quantize_embeddings

    return quantize_embeddings(workload._Holder(ebc), dtype=QUANT_DTYPES[dtype], inplace=True)


def quantized_rows(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Every table's quantized rows in ``module`` (scale and bias included, row
    padding too), by table name: views of the FBGEMM modules' storage."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    rows: Dict[str, torch.Tensor] = {}
    for m in module.modules():
        # An unsharded quantized EBC keeps its FBGEMM modules in a plain list.
        for tbe in [m, *getattr(m, "_emb_modules", ())]:
            if isinstance(tbe, IntNBitTableBatchedEmbeddingBagsCodegen):
                for spec, (w, _) in zip(tbe.embedding_specs, tbe.split_embedding_weights(split_scale_shifts=False)):
                    rows[spec[0]] = w
    return rows


def torchrec_quant(ebc: EmbeddingBagCollection, dtype: str, world: int, device: torch.device) -> nn.Module:
    """TorchRec's serving path: ``ebc`` quantized, sharded table-wise by TorchRec's
    ``shard_quant_model`` over ``world`` devices driven by this process, with the
    quantized rows copied in (TorchRec's sharding makes new FBGEMM modules; their
    rows may be padded otherwise, so the bytes of each row are copied, not the
    state dict)."""
    from torchrec.distributed import global_settings
    from torchrec.inference.modules import shard_quant_model

    model = quantized(ebc, dtype)
    rows = {name: w.clone() for name, w in quantized_rows(model).items()}
    if device.type == "cpu":
        # TorchRec's inference sharding and its forward keep to the CPU only when told
        # to, for the process (its inference modules alone read it).
        global_settings.set_propogate_device(True)
    model, _ = shard_quant_model(model, world_size=world, compute_device=device.type, sharding_device=device.type)
    for name, dst in quantized_rows(model).items():
        width = min(dst.size(1), rows[name].size(1))
        dst[:, :width].copy_(rows[name][:, :width])
    return model


# ------------------------------------------------------------------- timing


def latencies(
    fn: Callable[[int], Any], iters: int, warmup: int, device: torch.device, pg: Optional[dist.ProcessGroup]
) -> List[float]:
    """Milliseconds of ``fn(i)`` for ``iters`` steps after ``warmup``: with ``pg``,
    every rank steps, starting together, and a step's time is its slowest rank's;
    without, this rank alone."""
    times = timing.step_times(fn, iters, warmup, device, pg)
    if pg is None:
        return times
    slowest = torch.tensor(times, dtype=torch.float64, device=device if dist.get_backend(pg) == "nccl" else "cpu")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=pg)
    return slowest.tolist()


def summary(path: str, batch_size: int, samples: int, times: Optional[List[float]], note: str = "") -> Dict[str, Any]:
    """One row of the report: ``path`` at ``batch_size`` samples per rank, ``samples``
    served per step (every rank's), from its step times (None: not measured, ``note``
    says why)."""
    row: Dict[str, Any] = {"batch_size": batch_size, "path": path, "note": note}
    if not times:
        return {**row, "p50_ms": None, "p99_ms": None, "samples_per_s": None}
    p50 = statistics.median(times)
    p99 = statistics.quantiles(times, n=100, method="inclusive")[98] if len(times) > 1 else times[0]
    return {**row, "p50_ms": p50, "p99_ms": p99, "samples_per_s": samples / (p50 / 1e3)}


def with_ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``rows`` with ``vs_ours``: each path's p50 over ``pgas eager``'s at the same
    batch size (above 1: slower than ours eager), None where either is missing."""
    ours = {r["batch_size"]: r["p50_ms"] for r in rows if r["path"] == PATHS[0]}
    out = []
    for r in rows:
        base = ours.get(r["batch_size"])
        ratio = r["p50_ms"] / base if r["p50_ms"] is not None and base else None
        out.append({**r, "vs_ours": ratio})
    return out


def _cell(value: Optional[float], fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    """The report: the setting, then one line per batch size and path."""
    lines = [
        f"# Quantized serving ({meta['quant']}): {meta['label']}",
        "",
        f"{meta['world']} x {meta['device']}; p50 and p99 of {meta['iters']} steps; samples/s: every rank's "
        f"samples per step over the p50; x ours: p50 over `{PATHS[0]}`'s (above 1: slower).",
        "",
        "| batch/rank | path | p50 ms | p99 ms | samples/s | x ours | note |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {r['path']} | {_cell(r['p50_ms'], '.3f')} | {_cell(r['p99_ms'], '.3f')} | "
            f"{_cell(r['samples_per_s'], ',.0f')} | {_cell(r.get('vs_ours'), '.2f')} | {r['note']} |"
        )
    if meta.get("checks"):
        lines += ["", "Checks of the outputs:", ""] + [f"- {check}" for check in meta["checks"]]
    return "\n".join(lines) + "\n"


def table(rows: List[Dict[str, Any]]) -> str:
    """The report's lines for a terminal."""
    lines = [f"{'batch/rank':>10}  {'path':<24}{'p50 ms':>10}{'p99 ms':>10}{'samples/s':>14}{'x ours':>8}  note"]
    for r in rows:
        lines.append(
            f"{r['batch_size']:>10}  {r['path']:<24}{_cell(r['p50_ms'], '.3f'):>10}{_cell(r['p99_ms'], '.3f'):>10}"
            f"{_cell(r['samples_per_s'], ',.0f'):>14}{_cell(r.get('vs_ours'), '.2f'):>8}  {r['note']}"
        )
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: str, title: str) -> bool:
    """p50 latency and samples/s against the batch size, one line per path; False if
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (lat, rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in PATHS:
        points = [(r["batch_size"], r["p50_ms"], r["samples_per_s"]) for r in rows if r["path"] == name and r["p50_ms"]]
        if not points:
            continue
        b, ms, sps = zip(*points)
        lat.plot(b, ms, marker="o", label=name)
        rate.plot(b, sps, marker="o", label=name)
    for ax, label in ((lat, "p50 latency (ms)"), (rate, "samples/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("samples per rank")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    lat.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(rows: List[Dict[str, Any]], meta: Dict[str, Any], out_dir: str) -> List[str]:
    """``serving.json``, ``serving.md`` and ``serving.png`` under ``out_dir``; returns
    the files written."""
    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, name) for name in ("serving.json", "serving.md", "serving.png")]
    with open(files[0], "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(files[1], "w") as f:
        f.write(markdown(rows, meta))
    if not plot(rows, files[2], f"quantized serving ({meta['quant']}), {meta['label']}"):
        files.pop()
    return files


# -------------------------------------------------------------------- the run


def _graph(fn: Callable[..., Any], *example: Any, model: nn.Module) -> Callable[..., Any]:
    from torchrec_pgas.graphs import capture

    with torch.no_grad():
        return capture(fn, *example, model=model)


def torchrec_graph(model: nn.Module, kjts: Sequence[KeyedJaggedTensor]) -> Callable[[KeyedJaggedTensor], Any]:
    """TorchRec's serving path (``torchrec_quant``) captured in a CUDA graph, replayed
    for any of ``kjts`` (batches of one shape); the step takes a KJT, whose values and
    lengths are copied in.

    TorchRec's input dist splits the batch by rank (``KJTOneToAll.forward``,
    torchrec/distributed/dist_data.py) with ``KeyedJaggedTensor.split``, which starts
    with ``length_per_key()``: unless the KJT carries them, the per-feature id counts
    are summed on the device and copied to pageable host memory
    (``_maybe_compute_length_per_key`` -> ``_safe_tolist`` -> ``_cuda_to_cpu_safe``,
    torchrec/sparse/jagged_tensor.py), which a capture refuses. A batch of fixed shape
    has them known on the host: the graph's KJT is built with them
    (``length_per_key=``, public), read once from the first batch, outside the graph.
    The split slices every rank's features by them, so every batch must have the same
    counts (at world size 1 the one split is the whole batch, which reads none).

    Raises:
        ValueError: the batches' counts differ (the graph would split them wrong).
    """
    keys, stride = kjts[0].keys(), kjts[0].stride()
    per_key = [int(n) for n in kjts[0].length_per_key()]
    differ = [i for i, kjt in enumerate(kjts) if list(kjt.length_per_key()) != per_key or kjt.keys() != keys]
    if differ:
        raise ValueError(
            f"batches {differ} have other ids per feature than batch 0: TorchRec's split by rank "
            f"(KeyedJaggedTensor.split) reads them per batch, a graph fixes them"
        )

    def step(values: torch.Tensor, lengths: torch.Tensor) -> Any:
        return model(
            KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=stride, length_per_key=per_key)
        )

    graph = _graph(step, kjts[0].values(), kjts[0].lengths(), model=model)
    return lambda kjt: graph(kjt.values(), kjt.lengths())


def _failure(e: BaseException) -> str:
    """A path's note for the error that left it out: its first line."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"n/a: {type(e).__name__}: {first[:160]}"


def run(
    args: argparse.Namespace, device: torch.device, pg: dist.ProcessGroup
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Every path at every batch size: the rows of the report (rank 0's are the ones)
    and the checks of the outputs, in words."""
    from torchrec_pgas.graphs import raise_errors
    from torchrec_pgas.quant import shard_quant_model

    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    # While rank 0 alone drives every GPU (TorchRec's path), the others wait on the host:
    # an NCCL barrier would hold a kernel on each of their GPUs meanwhile.
    host_pg = dist.new_group(backend="gloo")
    base = base_config(args, world)
    ebc = float_tables(base, device)
    owners = {f"t{i}": s.rank for i, s in enumerate(table_specs(base))}
    gpu = device.type == "cuda"
    # TorchRec's one-process path: rank 0 drives every GPU; on CPUs it has one device.
    torchrec_note = "" if gpu or world == 1 else "n/a: TorchRec's one-process path drives GPUs only"
    tr_model = None
    if rank == 0 and not torchrec_note:
        try:
            tr_model = torchrec_quant(ebc, args.quant, world, device)
        except Exception as e:  # noqa: BLE001 - reported as the path's note
            torchrec_note = _failure(e)
    tr_graph_note = "" if gpu else "n/a: CUDA graphs need GPUs"
    float_model = None if args.no_float else workload.build(base, "table_wise", device, pg)
    rows: List[Dict[str, Any]] = []
    checks: List[str] = []
    progress = tqdm(total=len(args.batch_sizes) * len(PATHS), desc="serving", disable=rank != 0)
    for cfg in batch_sweep([base], args.batch_sizes):
        b, samples = cfg.batch_size, cfg.batch_size * world
        kjts = workload.batches(cfg, device, BATCHES, rank)
        times: Dict[str, Optional[List[float]]] = {}
        notes: Dict[str, str] = {}

        def step_of(fn: Callable[[KeyedJaggedTensor], Any], batches: List[KeyedJaggedTensor]) -> Callable[[int], Any]:
            return lambda i: fn(batches[i % len(batches)])

        # Ours: a model per batch size (buffers are sized at the first), captured too.
        ours = shard_quant_model(quantized(ebc, args.quant), pg, owners=owners)
        step = None
        with torch.no_grad():
            first = ours.ebc(kjts[0]).to_dict()
        if gpu:
            step = _graph(ours, kjts[0], model=ours)
            graphed = step(kjts[0]).clone()
            diff = float((graphed - torch.cat([first[k] for k in kjts[0].keys()], dim=1)).abs().max())
            checks.append(f"batch {b}: pgas graphed vs eager, max abs difference {diff:.3g} (rank {rank})")
        else:
            notes["pgas graphed"] = "n/a: CUDA graphs need GPUs"
        # TorchRec's serving path runs on rank 0, the others waiting. At world size 1 it
        # is timed interleaved with ours (``paired``): their ratio is then fair to
        # both whatever the host does meanwhile; on more ranks ours steps every rank.
        notes["torchrec quant"] = notes["torchrec quant graphed"] = torchrec_note
        tr_kjts: List[KeyedJaggedTensor] = []
        if tr_model is not None:
            global_cfg = dataclasses.replace(cfg, batch_size=samples)
            tr_kjts = kjts if world == 1 else workload.batches(global_cfg, device, BATCHES, 0)
        paired = world == 1 and tr_model is not None

        def timed(ours_path: str, ours_fn: Any, tr_path: str, tr_fn: Any) -> None:
            """Times ours and TorchRec's (either may be None) at this batch size. Every
            rank calls it, at the same points: ours steps every rank, so no rank starts
            before rank 0 is done with what it did alone."""
            with torch.no_grad():
                if paired and ours_fn is not None and tr_fn is not None:
                    fns = [step_of(ours_fn, kjts), step_of(tr_fn, tr_kjts)]
                    times[ours_path], times[tr_path] = timing.paired_step_times(fns, args.iters, args.warmup, device)
                    return
                dist.barrier(group=host_pg)
                if ours_fn is not None:
                    times[ours_path] = latencies(step_of(ours_fn, kjts), args.iters, args.warmup, device, pg)
                if tr_fn is not None:
                    times[tr_path] = latencies(step_of(tr_fn, tr_kjts), args.iters, args.warmup, device, None)
                dist.barrier(group=host_pg)

        if tr_model is not None and world == 1:
            with torch.no_grad():
                theirs = tr_model.ebc(kjts[0]).to_dict()
            diff = max(float((theirs[k] - first[k]).abs().max()) for k in first)
            checks.append(f"batch {b}: pgas eager vs torchrec quant, max abs difference {diff:.3g}")
        timed("pgas eager", ours, "torchrec quant", tr_model)
        progress.update(2)

        if float_model is not None:
            forward, _ = workload.step_fns(float_model)
            times["float table_wise"] = latencies(step_of(forward, kjts), args.iters, args.warmup, device, pg)
        else:
            notes["float table_wise"] = "left out (--no-float)"
        progress.update()

        # TorchRec's capture last: a capture that fails may leave the device's state
        # behind it unclear. On more ranks ours is timed first (every rank steps it,
        # none waiting for rank 0's capture); at world size 1 after, interleaved.
        if not paired:
            timed("pgas graphed", step, "torchrec quant graphed", None)
        tr_step = None
        if tr_model is not None and not tr_graph_note:
            try:
                tr_step = torchrec_graph(tr_model, tr_kjts)
                with torch.no_grad():
                    eager = tr_model(tr_kjts[0]).clone()
                diff = float((tr_step(tr_kjts[0]) - eager).abs().max())
                checks.append(f"batch {b}: torchrec quant graphed vs eager, max abs difference {diff:.3g}")
            except Exception as e:  # noqa: BLE001 - reported as the path's note
                tr_step = None
                tr_graph_note = _failure(e)  # not tried again: the same step fails the same way
        if tr_model is not None:
            notes["torchrec quant graphed"] = tr_graph_note
        timed("pgas graphed", step if paired else None, "torchrec quant graphed", tr_step)
        raise_errors(ours, wait=True)
        progress.update(2)
        del ours, step, tr_step
        gc.collect()
        rows += [summary(path, b, samples, times.get(path), notes.get(path, "")) for path in PATHS]
    progress.close()
    return with_ratios(rows), checks


def main(argv: Optional[Sequence[str]] = None) -> None:
    from torchrec_pgas.process import finish, start_rank

    args = parse(argv)
    device = start_rank()
    pg = dist.group.WORLD
    rows, checks = run(args, device, pg)
    if dist.get_rank() == 0:
        base = base_config(args, dist.get_world_size())
        meta = {
            "quant": args.quant,
            "label": base.label().replace(f"{base.batch_size}/rank, ", ""),
            "world": dist.get_world_size(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "iters": args.iters,
            "warmup": args.warmup,
            "checks": checks,
        }
        print(table(rows))
        for check in meta["checks"]:
            print(check)
        for path in write(rows, meta, args.out):
            print(f"wrote {path}")
    sys.stdout.flush()
    finish()


if __name__ == "__main__":
    main()
