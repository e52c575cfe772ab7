"""One step of each sharding inside a profiler capture range, for Nsight Compute or
Nsight Systems, and Nsight Compute's per-kernel numbers as a table.

    export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \\
        MASTER_PORT=29561 NVSHMEM_SYMMETRIC_SIZE=16G
    M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    M=$M,dram__bytes_read.sum,dram__bytes_write.sum
    ncu --clock-control none --profile-from-start off --csv --page raw --metrics $M \\
        python3 -m torchrec_pgas.benchmark.nsight --scenario dlrm --batch-size 32768 > ncu.csv
    python3 -m torchrec_pgas.benchmark.nsight --table ncu.csv

Per sharding of ``--shardings`` (by default TorchRec's, then ours, of the scenario's
pair), in that order, one at a time on the device: the benchmark's model
(``workload.build``) on its batches, ``--warmup`` training steps (compiling the
kernels, sizing the buffers), then one more step (``--step train``) or inference
forward (``--step forward``) between ``cudaProfilerStart`` and ``cudaProfilerStop``,
so that a profiler started with its capture range off (``ncu --profile-from-start off``,
``nsys --capture-range=cudaProfilerApi``) records exactly those steps, the shardings'
kernels one after the other. A step's kernels are not timed here: the benchmark times
steps, the profiler kernels.

``--table FILE`` reads Nsight Compute's raw CSV (``--csv --page raw``; lines that are
not CSV, such as the program's own output, are skipped) and prints per kernel launch,
in launch order: its name, its time, its DRAM throughput as a share of the peak, the
bytes it read from and wrote to DRAM (whichever of those metrics the CSV has), then
the total time.
"""

import argparse
import csv
import io
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from torchrec_pgas.benchmark import timing, workload
from torchrec_pgas.benchmark.config import (
    DEFAULT_SCALE,
    Config,
    add_config_args,
    add_options_args,
    base_config,
    dlrm_config,
    pgas_options,
)

#: Per scenario, the shardings profiled by default: TorchRec's, then ours.
PAIRS: Dict[str, str] = {
    "r1": "table_wise,pgas_table_wise",
    "r1_row_wise": "row_wise,pgas_row_wise",
    "dlrm": "table_wise+row_wise,pgas_table_wise+pgas_row_wise",
}
#: Nsight Compute's metrics the table shows, with their headings and their base units
#: (what a CSV without a units' row holds).
COLUMNS = (
    ("gpu__time_duration.sum", "us", "nsecond"),
    ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM %", "%"),
    ("dram__bytes_read.sum", "read MB", "byte"),
    ("dram__bytes_write.sum", "written MB", "byte"),
)
#: A value in each unit Nsight Compute may print, in the table's (us, MB, %). Times
#: come as "ns" from Nsight Compute 2025.3, as "nsecond" from older releases.
UNITS = {
    "nsecond": 1e-3,
    "usecond": 1.0,
    "msecond": 1e3,
    "second": 1e6,
    "ns": 1e-3,
    "us": 1.0,
    "ms": 1e3,
    "s": 1e6,
    "byte": 1e-6,
    "Kbyte": 1e-3,
    "Mbyte": 1.0,
    "Gbyte": 1e3,
    "%": 1.0,
}


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", metavar="CSV", help="print Nsight Compute's raw CSV as a table, and nothing else")
    p.add_argument("--scenario", choices=sorted(PAIRS), default="r1", help="R1's tables, or the DLRM-shaped ones")
    p.add_argument("--shardings", default=None, help="comma-separated (default: the scenario's pair)")
    p.add_argument("--step", choices=("train", "forward"), default="train")
    p.add_argument("--warmup", type=int, default=3, help="training steps before the profiled one")
    add_config_args(p)
    add_options_args(p)
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error(f"--warmup must be at least 1 (the first step sizes the buffers), got {args.warmup}")
    return args


def config(args: argparse.Namespace, world: int) -> Config:
    """The configuration ``args`` describe: R1's shape at their sizes, or the DLRM-shaped
    tables at ``--scale`` (default ``DEFAULT_SCALE``)."""
    base = base_config(args, world)
    if args.scenario == "dlrm":
        return dlrm_config(base, args.scale or DEFAULT_SCALE)
    return base


def profile_steps(
    args: argparse.Namespace, device: torch.device, begin: Callable[[], None], end: Callable[[], None]
) -> List[str]:
    """Each sharding's step (see the module docstring) between ``begin()`` and
    ``end()`` (the capture range's start and stop), the device idle at both; returns
    the shardings in the order profiled."""
    pg, rank = dist.group.WORLD, dist.get_rank()
    cfg = config(args, dist.get_world_size())
    kjts = workload.batches(cfg, device, 2, rank)
    shardings = (args.shardings or PAIRS[args.scenario]).split(",")
    for sharding in shardings:
        model = workload.build(cfg, sharding, device, pg, options=pgas_options(args))
        with torch.no_grad():
            out = model(kjts[0])
        grads = [torch.rand_like(out) for _ in kjts]
        forward, train_step = workload.steps(model, kjts, grads)
        for i in range(args.warmup):
            train_step(i)
        timing.sync(device)
        dist.barrier()
        begin()
        (train_step if args.step == "train" else forward)(args.warmup)
        timing.sync(device)
        end()
        if rank == 0:
            print(f"profiled one {args.step} step of {sharding}: {cfg.label()}", flush=True)
        del model, forward, train_step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return shardings


def table(text: str) -> str:
    """Nsight Compute's raw CSV (``text``) as a markdown table (see the module docstring)."""
    rows = list(csv.reader(io.StringIO("\n".join(line for line in text.splitlines() if line.startswith('"')))))
    if not rows or "Kernel Name" not in rows[0]:
        raise ValueError("no Nsight Compute raw CSV found (expected a header with 'Kernel Name')")
    header = rows[0]
    name = header.index("Kernel Name")
    # The row after the header gives each column's unit (its ID empty); without it,
    # base units.
    units = rows[1] if len(rows) > 1 and not rows[1][0].strip() else []
    columns = []
    for metric, heading, base in COLUMNS:
        if metric in header:
            i = header.index(metric)
            unit = (units[i] if i < len(units) else "") or base
            if unit not in UNITS:
                raise ValueError(f"{metric} is in {unit!r}, a unit this table does not know ({', '.join(UNITS)})")
            columns.append((i, heading, UNITS[unit]))
    lines = [
        "| kernel | " + " | ".join(h for _, h, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    total_us = 0.0
    for row in rows[1:]:
        # The units' row (and any other without an ID) is not a launch.
        if not row or not row[0].strip() or len(row) < len(header):
            continue
        values: List[str] = []
        for i, heading, scale in columns:
            value = float(row[i].replace(",", "")) * scale
            total_us += value if heading == "us" else 0.0
            values.append(f"{value:.1f}")
        lines.append(f"| `{row[name][:64]}` | " + " | ".join(values) + " |")
    return "\n".join(lines) + f"\n\ntotal {total_us:.1f} us\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv)
    if args.table is not None:
        with open(args.table) as f:
            print(table(f.read()), end="")
        return
    from torchrec_pgas.process import finish, start_rank

    if not torch.cuda.is_available():
        raise SystemExit("profiling a step needs GPUs (its capture range is CUDA's); torch sees no CUDA device here")
    device = start_rank()
    cudart = torch.cuda.cudart()
    profile_steps(args, device, cudart.cudaProfilerStart, cudart.cudaProfilerStop)
    finish()


if __name__ == "__main__":
    main()
