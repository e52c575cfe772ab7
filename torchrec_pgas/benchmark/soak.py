"""A soak: ``pgas_table_wise`` and TorchRec's ``table_wise`` trained side by side on the
same weights and batches for a fixed time, checking that they stay bit-identical and
reporting how steady the PGAS training step is.

    torchrun --standalone --nproc_per_node=2 -m torchrec_pgas.benchmark.soak --minutes 5

Every step trains both models (``EXACT_SGD``, fused); every ``--check-every`` steps the
two outputs are compared bit for bit. Per window of ``--window-s`` seconds it reports
the PGAS step's median time (CUDA events) and its steps per second; at the end the
spread of the window medians, a JSON file and, where matplotlib is present, a PNG.
"""

import argparse
import json
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from torchrec_pgas.benchmark import workload
from torchrec_pgas.benchmark.config import add_config_args, base_config
from torchrec_pgas.process import finish, start_rank


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--check-every", type=int, default=100)
    p.add_argument("--out", type=str, default="soak", help="writes OUT.json (and OUT.png)")
    return p.parse_args()


def _plot(windows: List[Dict[str, float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([w["t_s"] for w in windows], [w["steps_per_s"] for w in windows], marker="o")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("pgas_table_wise training steps/s")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)


def _train(
    args: argparse.Namespace,
    pgas: torch.nn.Module,
    tw: torch.nn.Module,
    batches: list,
    grads: List[torch.Tensor],
    device: torch.device,
) -> Tuple[List[Dict[str, float]], int, int, int]:
    """Trains both models until rank 0's clock says the time is up; returns the
    windows, the training steps, the mismatching checks and the checks."""
    windows: List[Dict[str, float]] = []
    times: List[float] = []
    steps, mismatches, checks = 0, 0, 0
    start = window_start = time.monotonic()
    bar = tqdm(total=int(args.minutes * 60), unit="s", disable=dist.get_rank() != 0)
    while True:
        # Every rank stops at the same step: rank 0's clock decides.
        if steps % 50 == 0:
            done = torch.tensor([time.monotonic() - start >= args.minutes * 60], device=device)
            dist.broadcast(done, src=0)
            if bool(done):
                break
        i = steps % len(batches)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = pgas(batches[i])
        out.backward(grads[i])
        end.record()
        expected = tw(batches[i])
        expected.backward(grads[i])
        end.synchronize()
        times.append(begin.elapsed_time(end))
        steps += 1
        if steps % args.check_every == 0:
            checks += 1
            mismatches += int(not torch.equal(out, expected))
        now = time.monotonic()
        if now - window_start >= args.window_s:
            median = statistics.median(times)
            windows.append({"t_s": now - start, "median_ms": median, "steps_per_s": len(times) / (now - window_start)})
            bar.update(int(now - window_start))
            times, window_start = [], now
    bar.close()
    return windows, steps, mismatches, checks


def _report(
    args: argparse.Namespace,
    world: int,
    steps: int,
    windows: List[Dict[str, float]],
    mismatches: int,
    checks: int,
    device: torch.device,
) -> None:
    """Prints the windows and their spread, writes OUT.json (and OUT.png)."""
    medians = [w["median_ms"] for w in windows]
    name = torch.cuda.get_device_name(device)
    print(f"\n{world} x {name}, {args.minutes} min, {steps} training steps of each model")
    print(f"{'t (s)':>8}{'median ms':>11}{'steps/s':>9}")
    for w in windows:
        print(f"{w['t_s']:>8.0f}{w['median_ms']:>11.3f}{w['steps_per_s']:>9.1f}")
    spread = (max(medians) - min(medians)) / statistics.median(medians) if medians else 0.0
    print(f"window medians: min {min(medians):.3f} ms, max {max(medians):.3f} ms, spread {spread:.1%}")
    print(f"bit-identical to table_wise at {checks - mismatches} of {checks} checks")
    with open(f"{args.out}.json", "w") as f:
        json.dump(
            {
                "args": vars(args),
                "world": world,
                "steps": steps,
                "windows": windows,
                "checks": checks,
                "mismatches": mismatches,
            },
            f,
            indent=1,
        )
    _plot(windows, f"{args.out}.png")


def main() -> None:
    args = _parse()
    device = start_rank()
    if device.type != "cuda":
        raise SystemExit("the soak runs on GPUs (one process per GPU); on CPUs see tests/test_reliability.py")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = base_config(args, world)
    batches = workload.batches(cfg, device, 8, rank)
    grads = [torch.randn(cfg.batch_size, cfg.tables * cfg.dim, device=device) for _ in batches]
    pg = dist.group.WORLD
    pgas, tw = workload.build(cfg, "pgas_table_wise", device, pg), workload.build(cfg, "table_wise", device, pg)
    windows, steps, mismatches, checks = _train(args, pgas, tw, batches, grads, device)
    counts = torch.tensor([mismatches, checks], device=device)
    dist.all_reduce(counts)
    if rank == 0:
        _report(args, world, steps, windows, int(counts[0]), int(counts[1]), device)
    finish()


if __name__ == "__main__":
    main()
