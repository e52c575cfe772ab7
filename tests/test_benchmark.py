"""The benchmark suite's harness: scenarios, the floor model, and a real (tiny) run on
two CPU processes that writes its JSON, markdown and plot. Speed itself is shown by
running the suite, never by a test."""

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from torchrec_pgas.benchmark.config import Config, scenarios
from torchrec_pgas.benchmark.floor import floor, link_chunks, traffic


def test_weak_scaling_keeps_per_rank_work_and_strong_scaling_keeps_the_global_work():
    base = Config(tables=8, batch_size=1024, ranks=8)
    weak, strong = scenarios(base, 8)["weak"], scenarios(base, 8)["strong"]
    assert [c.ranks for c in weak] == [1, 2, 4, 8] == [c.ranks for c in strong]
    assert all(c.tables / c.ranks == 1 and c.batch_size == 1024 for c in weak)
    assert all(c.tables == 8 and c.batch_size * c.ranks == 8 * 1024 for c in strong)


def test_traffic_counts_the_busiest_owner():
    cfg = Config(tables=3, rows=10, dim=4, batch_size=5, ids_per_bag=2, ranks=2)
    t = traffic(cfg)
    owned = 2  # ranks own tables 0, 2 and 1: rank 0 owns two
    lookups = owned * 2 * 5 * 2
    assert t.memory_bytes == lookups * (4 * 4 + 8) + owned * 2 * 5 * 4 * 4
    assert t.link_bytes == 1 * 5 * 2 * 8 + owned * 1 * 5 * 4 * 4
    assert traffic(Config(tables=3, ranks=1)).link_bytes == 0
    parts = floor(cfg, copy_gbps=2.0, link_gbps=0.5)
    assert math.isclose(parts.memory_ms, t.memory_bytes / 2.0 / 1e6)
    assert math.isclose(parts.link_ms, t.link_bytes / 0.5 / 1e6)
    assert parts.floor_ms == max(parts.memory_ms, parts.link_ms)  # overlapped: the slower part
    assert floor(Config(tables=3, ranks=1), copy_gbps=1.0, link_gbps=0.0).link_ms == 0.0  # nothing crosses


def test_link_measurement_puts_every_byte_once_from_many_blocks():
    nbytes, src, blocks = (64 << 20) + 12345, 1 << 40, 32
    chunks = link_chunks(nbytes, src, blocks)
    dst_offset, src_address, size = chunks[:, 0, 0], chunks[:, 0, 1], chunks[:, 0, 2]
    assert chunks.shape == (32, 1, 3) and chunks.dtype == torch.int64  # 32 rows x 32 blocks
    assert (size == size[0]).all() and int(size[0]) % (blocks * 16) == 0  # equal aligned shares per block
    assert torch.equal(dst_offset, torch.arange(32) * size[0])  # back to back, no overlap, from 0
    assert torch.equal(src_address, src + dst_offset)
    assert int(size.sum()) == 64 << 20  # rounded down by less than a unit (32 x 32 x 16 bytes)
    with pytest.raises(ValueError, match="at least 16384 bytes, got 100"):
        link_chunks(100, src, blocks)


def test_suite_runs_on_two_cpu_processes_and_writes_its_report(tmp_path):
    out = str(tmp_path / "bench")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "torchrec_pgas.benchmark",
        "--suite",
        "r1,weak,zipf,large_tables",
        "--tables",
        "4",
        "--rows",
        "300",
        "--dim",
        "8",
        "--batch-size",
        "16",
        "--ids-per-bag",
        "3",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--out",
        out,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    rows, host = results["rows"], results["meta"]["host"]
    assert host["cpu"] and 0 < host["alloc_us"] < 1e4  # what moves the ratios between machines
    assert [(r["scenario"], r["config"]["ranks"]) for r in rows] == [
        ("r1", 2),
        ("weak", 1),
        ("weak", 2),
        ("zipf", 2),
        ("large_tables", 2),
    ]
    assert rows[-1]["config"]["tables"] == 4 and rows[-1]["config"]["rows"] == 3000
    assert all(len(r["speedup_per_round"]["forward_ms"]) == 2 and r["wall_s"] > 0 for r in rows)
    assert all(r["identical"] for r in rows), "pgas_table_wise must equal table_wise bit for bit"
    assert all(r["pair"] == ["table_wise", "pgas_table_wise"] for r in rows)
    assert all(r["ours"][k] > 0 and r["baseline"][k] > 0 for r in rows for k in ("forward_ms", "dlrm_ms", "train_ms"))
    # Both parts of the floor, at bandwidths measured in the run; a single rank has no link part.
    assert all(r["copy_gbps"] > 0 and r["memory_ms"] > 0 for r in rows)
    assert all((r["link_gbps"] > 0 and r["link_ms"] > 0) == (r["config"]["ranks"] > 1) for r in rows)
    assert all(r["floor_ms"] == max(r["memory_ms"], r["link_ms"]) for r in rows)
    table = open(os.path.join(out, "results.md")).read()
    assert table.count("pgas_table_wise vs table_wise") == 5 and "rounds" in table
    assert f"{host['alloc_us']:.1f} us per small allocation" in table.splitlines()[0]
    assert f"{rows[0]['link_ms']:.3f} at {rows[0]['link_gbps']:.0f} GB/s" in table
    assert os.path.getsize(os.path.join(out, "speedup.png")) > 0


def test_profile_runs_on_two_cpu_processes_and_writes_its_profiles(tmp_path):
    out = str(tmp_path / "prof")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "torchrec_pgas.benchmark.profile",
        "--tables",
        "4",
        "--rows",
        "300",
        "--dim",
        "8",
        "--batch-size",
        "16",
        "--ids-per-bag",
        "3",
        "--iters",
        "3",
        "--out",
        out,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    timed = [line.split()[:2] for line in done.stdout.splitlines() if "step_ms" in line]
    assert timed == [[s, step] for s in ("pgas_table_wise", "table_wise") for step in ("forward", "train_step")]
    for s in ("pgas_table_wise", "table_wise"):
        with open(os.path.join(out, f"cprofile_{s}_forward.txt")) as f:
            assert "Ordered by: cumulative time" in f.read()
        for step, rank in itertools.product(("forward", "train_step"), (0, 1)):
            assert os.path.getsize(os.path.join(out, f"torch_profile_{s}_{step}.txt")) > 0
            with open(os.path.join(out, f"torch_profile_{s}_{step}_rank{rank}.json")) as f:
                assert json.load(f)["traceEvents"], (s, step, rank)
