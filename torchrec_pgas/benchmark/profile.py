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
``--sparse-update fbgemm`` profiles our training step with FBGEMM's backward instead of
the fused update (``PgasOptions.sparse_update``).

``--cuda-graph`` (GPUs) profiles the inference forward on the device instead, eager
and captured in a CUDA graph (``torchrec_pgas.graphs.capture``, as the benchmark's
graphed columns take it; shardings of PGAS types only, TorchRec's cannot be captured),
at each of ``--batch-sizes`` (else ``--batch-size``):

    NVSHMEM_SYMMETRIC_SIZE=16G torchrun --standalone --nproc_per_node=1 \\
        -m torchrec_pgas.benchmark.profile --cuda-graph --batch-sizes 1024,8192 --out prof_graph

Per sharding, batch size and mode: the slowest rank's median step by CUDA events (the
benchmark's number), then ``--replays`` steps under ``torch.profiler``, each marked,
timed by CUDA events and drained before the next, so that a step's device activities
(kernels, copies and fills, also those a graph replay launches: CUPTI traces them)
are its own. From rank 0's trace: each activity's count and device time over the
steps (``OUT/graph_kernels_<sharding>_<batch>_<mode>.txt``), and the timeline of the
profiled step of median span: its device span (first start to last end), the busy
time within it (the union of the activities), the device idle inside the span (span
minus busy: the gaps between dependent kernels), and what lies outside it (the step's
time minus its span: launching, the host; under the profiler, which slows the host).
Against it, the floor's memory part (``floor``: rows and ids read, pooled rows
written, over the copy bandwidth measured in the run), and how much of the copy
bandwidth the step's longest kernel would reach moving those bytes. The summary is
printed last and written to ``OUT/graph_profile.md`` (numbers in ``OUT/graph_profile.json``), the
timelines to ``OUT/graph_trace_<sharding>_<batch>_<mode>_rank<r>.json``.
"""

import argparse
import bisect
import cProfile
import dataclasses
import gc
import io
import json
import os
import pstats
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
from tqdm import tqdm

from torchrec_pgas.benchmark import floor, timing, workload
from torchrec_pgas.benchmark.config import Config, add_config_args, add_options_args, base_config, pgas_options
from torchrec_pgas.process import finish, start_rank


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shardings", default="pgas_table_wise,table_wise", help="comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="profile_results")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="GPUs only: profile the forward on the device, eager and captured in a CUDA graph (see above)",
    )
    p.add_argument("--replays", type=int, default=20, help="--cuda-graph: steps profiled per sharding and mode")
    p.add_argument("--warmup", type=int, default=10, help="--cuda-graph: untimed steps before the timed ones")
    add_config_args(p)
    add_options_args(p)
    args = p.parse_args(argv)
    if args.cuda_graph and not torch.cuda.is_available():
        p.error("--cuda-graph needs GPUs (it captures CUDA graphs), and torch sees no CUDA device here")
    for name in ("iters", "replays"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def _times(fn: Callable[[int], None], iters: int, device: torch.device) -> Dict[str, float]:
    """Median ms per call: around one call started on an idle device (what the
    benchmark reports), the host's time in the call, and back to back."""
    for i in range(10):
        fn(i)
    timing.sync(device)
    step, host = [], []
    for i in range(iters):
        dist.barrier()
        timing.sync(device)
        begin = time.perf_counter()
        fn(i)
        called = time.perf_counter()
        timing.sync(device)
        step.append((time.perf_counter() - begin) * 1e3)
        host.append((called - begin) * 1e3)
    dist.barrier()
    begin = time.perf_counter()
    for i in range(iters):
        fn(i)
    timing.sync(device)
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
    timing.sync(device)
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
        timing.sync(device)
    # Every rank's timeline (chrome://tracing, Perfetto): a step waits for its slowest rank.
    prof.export_chrome_trace(path.replace(".txt", f"_rank{dist.get_rank()}.json"))
    if dist.get_rank() == 0:
        averages = prof.key_averages()
        with open(path, "w") as f:
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
            if device.type == "cuda":
                f.write(averages.table(sort_by="self_cuda_time_total", row_limit=25))


#: The trace's categories of device activities: kernels, and the copies and fills
#: that take device time as kernels do (the graph's input copies among them).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: The name of each profiled step's range in the trace (``record_function``).
STEP_MARK = "pgas_profile_step"
#: Kernels named in the summary per profile; the rest are counted together.
TOP_KERNELS = 12


@dataclass(frozen=True)
class Activity:
    """One device activity of a step: its name, start and duration (us)."""

    name: str
    start_us: float
    dur_us: float


def step_activities(
    events: Sequence[Dict[str, Any]], categories: Sequence[str] = DEVICE_CATEGORIES
) -> List[List[Activity]]:
    """The device activities of each step marked ``STEP_MARK`` in a chrome trace's
    events, in the steps' order.

    An activity belongs to the step in which the host launched it: the launch (a
    runtime or driver call; one ``cudaGraphLaunch`` for every kernel of a replay)
    shares the activity's correlation id and lies within the step's mark. Activities
    without a launch in the trace go by their own start. Those of no step (a barrier's
    kernels between steps) are left out."""
    marks = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_MARK)),
        key=lambda e: float(e["ts"]),
    )
    starts = [float(m["ts"]) for m in marks]
    launches = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    steps: List[List[Activity]] = [[] for _ in marks]
    for e in events:
        if e.get("cat") not in categories or e.get("ph") != "X":
            continue
        start = float(e["ts"])
        at = launches.get(e.get("args", {}).get("correlation"), start)
        i = bisect.bisect_right(starts, at) - 1
        if i >= 0 and at <= starts[i] + float(marks[i].get("dur", 0)):
            steps[i].append(Activity(str(e["name"]), start, float(e.get("dur", 0))))
    return steps


@dataclass(frozen=True)
class DeviceStep:
    """One step's device timeline (us)."""

    #: From the first activity's start to the last one's end.
    span_us: float
    #: Time within the span when some activity ran (their union).
    busy_us: float
    #: The activities' durations added up (more than ``busy_us`` where they overlap).
    kernel_us: float
    activities: int

    @property
    def idle_us(self) -> float:
        """The device's idle time inside the span: the gaps between activities."""
        return self.span_us - self.busy_us


def device_step(activities: Sequence[Activity]) -> DeviceStep:
    """The timeline of one step's activities (all zero without any)."""
    if not activities:
        return DeviceStep(0.0, 0.0, 0.0, 0)
    ordered = sorted(activities, key=lambda a: a.start_us)
    busy, end = 0.0, ordered[0].start_us
    for a in ordered:
        stop = a.start_us + a.dur_us
        if stop > end:
            busy += stop - max(a.start_us, end)
            end = stop
    span = max(a.start_us + a.dur_us for a in ordered) - ordered[0].start_us
    return DeviceStep(span, busy, sum(a.dur_us for a in ordered), len(ordered))


@dataclass(frozen=True)
class KernelRow:
    """One activity's name, count and total device time over the profiled steps."""

    name: str
    count: int
    total_us: float

    @property
    def mean_us(self) -> float:
        return self.total_us / self.count


def kernel_table(steps: Sequence[Sequence[Activity]]) -> List[KernelRow]:
    """Per activity name over all ``steps``: count and total time, longest first."""
    count: Dict[str, int] = {}
    total: Dict[str, float] = {}
    for a in (a for step in steps for a in step):
        count[a.name] = count.get(a.name, 0) + 1
        total[a.name] = total.get(a.name, 0.0) + a.dur_us
    return sorted((KernelRow(n, count[n], total[n]) for n in count), key=lambda k: (-k.total_us, k.name))


@dataclass(frozen=True)
class StepProfile:
    """Where one forward's time goes on the device (see module doc), in us: the step's
    time, the activities over all profiled steps, and the timeline of the profiled
    step of median span (one step's, so that its span is its busy plus idle time)."""

    sharding: str
    batch_size: int
    mode: str
    #: The median step by CUDA events (the benchmark's number), not profiled.
    step_us: float
    #: Profiled steps with device activity.
    steps: int
    #: The profiled step of median span: its time by CUDA events, and its timeline.
    profiled_step_us: float
    span_us: float
    busy_us: float
    kernel_us: float
    idle_us: float
    kernels: List[KernelRow]
    floor: floor.Floor

    @property
    def outside_us(self) -> float:
        """The profiled step's time before its first activity and after its last:
        launching, the host's work."""
        return self.profiled_step_us - self.span_us

    @property
    def memory_floor_us(self) -> float:
        return self.floor.memory_ms * 1e3

    def per_step_us(self, row: KernelRow) -> float:
        return row.total_us / max(self.steps, 1)

    def copy_share(self, row: KernelRow) -> float:
        """The fraction of the copy bandwidth ``row``'s kernel would reach if it moved
        all the forward's memory bytes (the floor's memory part) in its time per step."""
        us = self.per_step_us(row)
        return self.memory_floor_us / us if us else 0.0


def summarize_steps(
    sharding: str,
    batch_size: int,
    mode: str,
    step_ms: float,
    steps: Sequence[Sequence[Activity]],
    profiled_ms: Sequence[float],
    parts: floor.Floor,
) -> StepProfile:
    """A ``StepProfile`` of the marked steps' activities (``step_activities``), each
    step timed at ``profiled_ms``, and the unprofiled median ``step_ms``."""
    if len(profiled_ms) != len(steps):
        raise ValueError(
            f"{len(steps)} marked steps in the trace, {len(profiled_ms)} timed: the trace is not the run's"
        )
    timed = sorted(((device_step(s), ms) for s, ms in zip(steps, profiled_ms) if s), key=lambda t: t[0].span_us)
    median, ms = timed[(len(timed) - 1) // 2] if timed else (device_step([]), 0.0)
    return StepProfile(
        sharding=sharding,
        batch_size=batch_size,
        mode=mode,
        step_us=step_ms * 1e3,
        steps=len(timed),
        profiled_step_us=ms * 1e3,
        span_us=median.span_us,
        busy_us=median.busy_us,
        kernel_us=median.kernel_us,
        idle_us=median.idle_us,
        kernels=kernel_table([s for s in steps if s]),
        floor=parts,
    )


def _short(name: str, width: int = 60) -> str:
    """A kernel's name for a table cell: templated C++ names run to hundreds of characters."""
    name = name.replace("|", "/")
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_markdown(p: StepProfile) -> str:
    """One profile: the step's parts, the floor, and its kernels per step."""
    title = f"### {p.sharding}, {p.batch_size} samples per rank, {p.mode}"
    if not p.steps:
        return f"{title}\n\nstep {p.step_us:.1f} us; no device activity in the trace\n"
    f = p.floor
    link = (
        f"link part {f.link_ms * 1e3:.1f} us at {f.link_gbps:.0f} GB/s" if f.link_bytes else "no link part (one rank)"
    )
    top = p.kernels[0]
    lines = [
        title,
        "",
        gist(p),
        "",
        f"step {p.step_us:.1f} us (median, not profiled). The profiled step of median span (of {p.steps}): "
        f"{p.profiled_step_us:.1f} us, device span {p.span_us:.1f} us: kernels {p.kernel_us:.1f} us "
        f"(busy {p.busy_us:.1f} us), idle {p.idle_us:.1f} us inside the span; {p.outside_us:.1f} us outside "
        f"it (launch, host).",
        "",
        f"floor: memory part {p.memory_floor_us:.1f} us ({f.memory_bytes / 1e6:.1f} MB at "
        f"{f.copy_gbps:.0f} GB/s copy), "
        f"{link}; `{_short(top.name, 40)}` {p.per_step_us(top):.1f} us per step, at "
        f"{100 * p.copy_share(top):.0f}% of copy bandwidth were it to move those bytes.",
        "",
        "| kernel (copy, fill) | per step | us per step | mean us | share of kernel time |",
        "|---|---|---|---|---|",
    ]
    total = sum(k.total_us for k in p.kernels) or 1.0
    for k in p.kernels[:TOP_KERNELS]:
        lines.append(
            f"| `{_short(k.name)}` | {k.count / p.steps:.3g} | {p.per_step_us(k):.1f} | {k.mean_us:.1f} "
            f"| {100 * k.total_us / total:.0f}% |"
        )
    rest = p.kernels[TOP_KERNELS:]
    if rest:
        us = sum(k.total_us for k in rest)
        count = sum(k.count for k in rest)
        lines.append(
            f"| {len(rest)} others | {count / p.steps:.3g} | {us / p.steps:.1f} | {us / count:.1f} "
            f"| {100 * us / total:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def gist(p: StepProfile) -> str:
    """The profile in one sentence: the longest kernel's share of the step and of copy
    bandwidth, the other kernels, and the idle time (in the span, and outside it)."""
    if not p.kernels:
        return f"{p.sharding}, {p.batch_size}, {p.mode}: no device activity in the trace"
    top, rest = p.kernels[0], p.kernels[1:]
    others = sum(p.per_step_us(k) for k in rest)
    count = sum(k.count for k in rest) / p.steps
    return (
        f"`{_short(top.name, 40)}` {p.per_step_us(top):.1f} us of {p.profiled_step_us:.1f} "
        f"(at {100 * p.copy_share(top):.0f}% of copy bandwidth); {count:.3g} other kernels "
        f"{others / count if count else 0.0:.1f} us each; idle {p.idle_us:.1f} us between kernels, "
        f"{p.outside_us:.1f} us before and after them."
    )


def summary_markdown(profiles: Sequence[StepProfile], header: str) -> str:
    """Each profile's kernels, then every profile on one line (us per step): last, where
    the end of a run's output shows it."""
    lines = [
        header,
        "",
        *(profile_markdown(p) for p in profiles),
        "### Summary (us per step)",
        "",
        "| sharding | samples | mode | step us | profiled step us | device span us | kernel us (sum) | idle in span us "
        "| outside span us "
        "| memory floor us | longest kernel: us per step, % of copy bandwidth | kernels per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in profiles:
        top = _longest(p)
        per_step = f"{sum(k.count for k in p.kernels) / p.steps:.3g}" if p.steps else "0"
        lines.append(
            f"| {p.sharding} | {p.batch_size} | {p.mode} | {p.step_us:.1f} | {p.profiled_step_us:.1f} "
            f"| {p.span_us:.1f} | {p.kernel_us:.1f} "
            f"| {p.idle_us:.1f} | {p.outside_us:.1f} | {p.memory_floor_us:.1f} | {top} | {per_step} |"
        )
    return "\n".join(lines) + "\n"


def _longest(p: StepProfile) -> str:
    """The longest activity of ``p``: its time per step and share of copy bandwidth."""
    if not p.kernels:
        return "n/a"
    k = p.kernels[0]
    return f"`{_short(k.name, 40)}` {p.per_step_us(k):.1f}, {100 * p.copy_share(k):.0f}%"


def graphable(sharding: str) -> bool:
    """Whether ``sharding``'s forward can be captured: PGAS types only (TorchRec's input
    dist reads split sizes back to the host)."""
    return all(kind.startswith("pgas_") for kind in sharding.split("+"))


def _timed_ms(fn: Callable[[int], None], i: int, device: torch.device) -> float:
    """``fn(i)`` timed as ``timing.median_ms`` times a step (CUDA events on GPUs), the
    device drained before it returns."""
    if device.type != "cuda":
        begin = time.perf_counter()
        fn(i)
        return (time.perf_counter() - begin) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _device_profile(
    fn: Callable[[int], None], cfg: Config, sharding: str, mode: str, parts: floor.Floor, device: torch.device, pg, args
) -> StepProfile:
    """``fn``'s median step (``timing.median_ms``), then ``args.replays`` steps profiled,
    each marked and drained; the timeline of every rank written, rank 0's summarized."""
    step_ms = timing.median_ms(fn, args.iters, args.warmup, device, pg)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiled: List[float] = []
    with profile(activities=activities) as prof:
        for i in range(args.replays):
            dist.barrier(group=pg)
            timing.sync(device)
            with record_function(f"{STEP_MARK} {i}"):
                profiled.append(_timed_ms(fn, i, device))
    name = f"{sharding}_{cfg.batch_size}_{mode}"
    path = os.path.join(args.out, f"graph_trace_{name}_rank{dist.get_rank(pg)}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        steps = step_activities(json.load(f)["traceEvents"])
    result = summarize_steps(sharding, cfg.batch_size, mode, step_ms, steps, profiled, parts)
    if dist.get_rank(pg) == 0:
        with open(os.path.join(args.out, f"graph_kernels_{name}.txt"), "w") as f:
            f.write(f"{'count':>7} {'total us':>11} {'mean us':>9}  name ({result.steps} steps)\n")
            f.writelines(f"{k.count:7d} {k.total_us:11.1f} {k.mean_us:9.2f}  {k.name}\n" for k in result.kernels)
    return result


def profile_forward(
    cfg: Config, sharding: str, parts: floor.Floor, device: torch.device, pg, args
) -> List[StepProfile]:
    """The forward of ``sharding`` on ``cfg`` profiled eager, then captured and replayed
    (where ``graphable``; a captured model takes no more eager steps)."""
    rank = dist.get_rank(pg)
    batches = [(kjt,) for kjt in workload.batches(cfg, device, 4, rank)]
    model = workload.build(cfg, sharding, device, pg, options=pgas_options(args))
    forward, _ = workload.step_fns(model)
    profiles = [_device_profile(workload.cycle(forward, batches), cfg, sharding, "eager", parts, device, pg, args)]
    if graphable(sharding):
        from torchrec_pgas.graphs import capture, raise_errors  # GPUs only: CPU runs never import it

        captured = capture(forward, *batches[0], model=model)
        replay = workload.cycle(captured, batches)
        profiles.append(_device_profile(replay, cfg, sharding, "graphed", parts, device, pg, args))
        raise_errors(model, wait=True)  # the replays' bad batches, if any: the numbers are then void
    del model, forward
    gc.collect()  # the model's buffers (and graph) go before the next one is built
    return profiles


def _profile_json(p: StepProfile) -> Dict[str, Any]:
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in ("kernels", "floor")}
    return {
        **fields,
        "outside_us": p.outside_us,
        "floor": p.floor.fields(),
        "kernels": [dataclasses.asdict(k) for k in p.kernels],
    }


def graph_main(args: argparse.Namespace, device: torch.device) -> None:
    """``--cuda-graph``: every sharding at every batch size (see module doc)."""
    pg, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    copy = floor.copy_gbps(device, 1 << (28 if cuda else 24))
    link = floor.link_gbps(pg, device, 1 << (26 if cuda else 24))
    base = base_config(args, world)
    work = [
        (dataclasses.replace(base, batch_size=b), s)
        for b in (args.batch_sizes or [base.batch_size])
        for s in args.shardings.split(",")
    ]
    profiles: List[StepProfile] = []
    for cfg, sharding in tqdm(work, desc="profiles", disable=rank != 0):
        profiles += profile_forward(cfg, sharding, floor.floor(cfg, copy, link), device, pg, args)
    if rank != 0:
        return
    hardware = f"{world} x {torch.cuda.get_device_name(device)}" if cuda else f"{world} CPU processes"
    not_graphed = [s for s in args.shardings.split(",") if not graphable(s)]
    sizes = "/".join(str(cfg.batch_size) for cfg in dict.fromkeys(cfg for cfg, _ in work))
    label = base.label().replace(f"{base.batch_size}/rank", f"{sizes}/rank")
    header = (
        f"{hardware}; {label}; step: median of {args.iters} by "
        f"{'CUDA events' if cuda else 'the host clock'}; "
        f"the rest: of {args.replays} profiled steps on rank 0 (activities: all; timeline: the median span's)."
        + (f" Not graphed (TorchRec's sharding cannot be captured): {', '.join(not_graphed)}." if not_graphed else "")
    )
    table = summary_markdown(profiles, header)
    with open(os.path.join(args.out, "graph_profile.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "graph_profile.json"), "w") as f:
        json.dump({"header": header, "profiles": [_profile_json(p) for p in profiles]}, f, indent=1)
    print("\n" + table, flush=True)


def main() -> None:
    args = _parse()
    device = start_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)
    if args.cuda_graph:
        graph_main(args, device)
        finish()
        return
    cfg = base_config(args, world)
    kjts = workload.batches(cfg, device, 4, rank)
    grads = [torch.randn(cfg.batch_size, cfg.tables * cfg.dim, device=device) for _ in kjts]
    lines: List[str] = []
    for sharding in tqdm(args.shardings.split(","), desc="shardings", disable=rank != 0):
        model = workload.build(cfg, sharding, device, dist.group.WORLD, options=pgas_options(args))
        forward, train_step = workload.steps(model, kjts, grads)
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
