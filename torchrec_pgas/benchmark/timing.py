"""Medians of repeated steps: CUDA events on GPUs, the host clock on CPUs."""

import platform
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (nothing to wait for on CPUs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(
    fn: Callable[[int], Any], iters: int, warmup: int, device: torch.device, pg: Optional[dist.ProcessGroup]
) -> List[float]:
    """This rank's milliseconds of ``fn(i)`` for ``iters`` runs after ``warmup``; with
    ``pg``, the ranks start each run together."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(iters):
        if pg is not None:
            dist.barrier(group=pg)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def paired_step_times(
    fns: Sequence[Callable[[int], Any]], iters: int, warmup: int, device: torch.device
) -> List[List[float]]:
    """This process's milliseconds of each of ``fns`` (``fn(i)``), ``iters`` runs each
    after ``warmup``, interleaved: run ``i`` steps every fn once, starting from a
    different one each run, so that a change of the host's speed during the
    measurement (other tenants, clocks) falls on every fn alike and their ratio stays
    fair. Timed one step at a time as ``step_times`` does."""
    for i in range(warmup):
        for fn in fns:
            fn(i)
    times: List[List[float]] = [[] for _ in fns]
    for i in range(iters):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            times[k] += step_times(lambda _: fns[k](i), 1, 0, device, None)
    return times


def median_ms(fn: Callable[[int], None], iters: int, warmup: int, device: torch.device, pg: dist.ProcessGroup) -> float:
    """The slowest rank's median time of ``fn(i)`` over ``iters`` runs after ``warmup``
    (a step is as fast as its slowest rank). Ranks start each run together."""
    times = step_times(fn, iters, warmup, device, pg)
    median = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=pg)
    return float(median)


def host(device: torch.device) -> Dict[str, Any]:
    """The host's CPU, and the median time of one small allocation on ``device``: the
    steps compared are largely the host's time, so their ratios move with its speed."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    times = []
    for _ in range(200):
        begin = time.perf_counter()
        for _ in range(10):
            torch.empty(8, device=device)
        times.append((time.perf_counter() - begin) * 1e5)  # us per allocation
    return {"cpu": cpu or "unknown", "alloc_us": statistics.median(times)}
