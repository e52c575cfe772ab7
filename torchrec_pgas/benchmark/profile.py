"""Where the time of a step goes: host time per call, and profiles of the forward.

    torchrun --standalone --nproc_per_node=2 -m torchrec_pgas.benchmark.profile \\
        --shardings pgas_table_wise,table_wise --out prof

For each sharding, on the benchmark's workload (R1 by default): the slowest rank's
median of the forward (inference) and of the training step, timed three ways (CUDA
events or the host clock around one call; the host time of the call alone; back to
back without barriers), then on rank 0 a cProfile of 30 calls of each
(``OUT/cprofile_<sharding>_<step>.txt``, by own time and by cumulative time) and a
``torch.profiler`` table of 5 calls of each (``OUT/torch_profile_<sharding>_<step>.txt``),
with every rank's timeline of them (``OUT/torch_profile_<sharding>_<step>_rank<r>.json``).
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from torchrec_pgas.benchmark import workload
from torchrec_pgas.benchmark.config import add_config_args, base_config
from torchrec_pgas.process import finish, start_rank


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shardings", default="pgas_table_wise,table_wise", help="comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="profile_results")
    add_config_args(p)
    return p.parse_args()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times(fn: Callable[[int], None], iters: int, device: torch.device) -> Dict[str, float]:
    """Median ms per call: around one call started on an idle device (what the
    benchmark reports), the host's time in the call, and back to back."""
    for i in range(10):
        fn(i)
    _sync(device)
    step, host = [], []
    for i in range(iters):
        dist.barrier()
        _sync(device)
        begin = time.perf_counter()
        fn(i)
        called = time.perf_counter()
        _sync(device)
        step.append((time.perf_counter() - begin) * 1e3)
        host.append((called - begin) * 1e3)
    dist.barrier()
    begin = time.perf_counter()
    for i in range(iters):
        fn(i)
    _sync(device)
    back_to_back = (time.perf_counter() - begin) * 1e3 / iters
    local = torch.tensor([statistics.median(step), statistics.median(host), back_to_back], device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return dict(zip(("step_ms", "host_ms", "back_to_back_ms"), local.tolist()))


def _cprofile(fn: Callable[[int], None], device: torch.device, path: str) -> None:
    """30 calls on every rank (they are collective), profiled on rank 0."""
    profiler = cProfile.Profile() if dist.get_rank() == 0 else None
    dist.barrier()
    if profiler is not None:
        profiler.enable()
    for i in range(30):
        fn(i)
    _sync(device)
    if profiler is None:
        return
    profiler.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(50)
    with open(path, "w") as f:
        f.write(text.getvalue())


def _torch_profile(fn: Callable[[int], None], device: torch.device, path: str) -> None:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(5):
            fn(i)
        _sync(device)
    # Every rank's timeline (chrome://tracing, Perfetto): a step waits for its slowest rank.
    prof.export_chrome_trace(path.replace(".txt", f"_rank{dist.get_rank()}.json"))
    if dist.get_rank() == 0:
        averages = prof.key_averages()
        with open(path, "w") as f:
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
            if device.type == "cuda":
                f.write(averages.table(sort_by="self_cuda_time_total", row_limit=25))


def main() -> None:
    args = _parse()
    device = start_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = base_config(args, world)
    os.makedirs(args.out, exist_ok=True)
    kjts = workload.batches(cfg, device, 4, rank)
    grads = [torch.randn(cfg.batch_size, cfg.tables * cfg.dim, device=device) for _ in kjts]
    lines: List[str] = []
    for sharding in tqdm(args.shardings.split(","), desc="shardings", disable=rank != 0):
        forward, train_step = workload.steps(workload.build(cfg, sharding, device, dist.group.WORLD), kjts, grads)
        for name, fn in (("forward", forward), ("train_step", train_step)):
            t = _times(fn, args.iters, device)
            lines.append(f"{sharding:18} {name:11} " + "  ".join(f"{k} {v:.3f}" for k, v in t.items()))
            _cprofile(fn, device, os.path.join(args.out, f"cprofile_{sharding}_{name}.txt"))
            _torch_profile(fn, device, os.path.join(args.out, f"torch_profile_{sharding}_{name}.txt"))
    if rank == 0:
        print(f"{cfg.label()}; median of {args.iters}, slowest rank")
        print("\n".join(lines))
    finish()


if __name__ == "__main__":
    main()
