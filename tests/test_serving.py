"""The quantized serving benchmark (``torchrec_pgas.benchmark.serving``) on CPUs: its
arguments, its report's numbers and formats, and whole runs on tiny tables (ours and
TorchRec's quantized serving path, the float table_wise model; graphs are GPU-only)."""

import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch
from dist_utils import torchrun_ok
from torchrec import KeyedJaggedTensor

from torchrec_pgas.benchmark import serving, timing, workload
from torchrec_pgas.benchmark.config import Config, base_config

TINY = ["--tables", "3", "--rows", "64", "--dim", "8", "--ids-per-bag", "3", "--iters", "4", "--warmup", "1"]


def test_defaults_are_r1_at_three_batch_sizes():
    args = serving.parse([])
    assert args.batch_sizes == [256, 1024, 8192] and args.quant == "int8" and not args.no_float
    cfg = base_config(args, 1)
    assert (cfg.tables, cfg.rows, cfg.dim, cfg.ids_per_bag, cfg.zipf_alpha) == (8, 1_000_000, 128, 20, 0.0)
    assert serving.parse(["--batch-sizes", "8,2", "--quant", "int4"]).batch_sizes == [8, 2]


@pytest.mark.parametrize("argv", [["--batch-sizes", "0,4"], ["--quant", "int2"], ["--iters", "0"], ["--warmup", "-1"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        serving.parse(argv)


def test_summary_percentiles_rate_and_ratios():
    times = [float(t) for t in range(100, 0, -1)]  # 1..100 ms, in any order
    row = serving.summary("pgas eager", 64, 128, times)
    assert row["p50_ms"] == 50.5
    # The 99th percentile, interpolated between the 99th and 100th of 100 values.
    assert row["p99_ms"] == pytest.approx(99.01)
    assert row["samples_per_s"] == pytest.approx(128 / 0.0505)
    missing = serving.summary("pgas graphed", 64, 128, None, "n/a: CUDA graphs need GPUs")
    assert missing["p50_ms"] is None and missing["samples_per_s"] is None
    other = serving.summary("torchrec quant", 64, 128, [101.0, 101.0])
    elsewhere = serving.summary("torchrec quant", 32, 64, [1.0])  # no ours at this batch size
    rows = serving.with_ratios([row, missing, other, elsewhere])
    assert [r["vs_ours"] for r in rows] == [1.0, None, pytest.approx(2.0), None]


def test_markdown_and_terminal_table():
    rows = serving.with_ratios(
        [
            serving.summary("pgas eager", 256, 512, [2.0, 2.0, 4.0]),
            serving.summary("torchrec quant graphed", 256, 512, None, "n/a: RuntimeError: capture failed"),
        ]
    )
    meta = {"quant": "int4", "label": "2 ranks, 8 x 1000000 x 128", "world": 2, "device": "CPU", "iters": 3}
    md = serving.markdown(rows, {**meta, "checks": ["batch 256: pgas eager vs torchrec quant, max abs 0"]})
    assert md.startswith("# Quantized serving (int4): 2 ranks, 8 x 1000000 x 128\n")
    assert "| 256 | pgas eager | 2.000 | 3.960 | 256,000 | 1.00 |  |" in md
    assert "| 256 | torchrec quant graphed | n/a | n/a | n/a | n/a | n/a: RuntimeError: capture failed |" in md
    assert "- batch 256: pgas eager vs torchrec quant, max abs 0" in md
    lines = serving.table(rows).splitlines()
    assert lines[0].split()[:3] == ["batch/rank", "path", "p50"]
    assert lines[1].split() == ["256", "pgas", "eager", "2.000", "3.960", "256,000", "1.00"]


def _run(tmp_path, nproc: int, *argv: str) -> dict:
    out = tmp_path / f"out{nproc}"
    args = ["-m", "torchrec_pgas.benchmark.serving", *TINY, *argv, "--out", str(out)]
    if nproc == 2:
        stdout = torchrun_ok(*args)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        stdout = done.stdout
    assert f"wrote {out / 'serving.md'}" in stdout
    assert os.path.getsize(out / "serving.png") > 1000
    with open(out / "serving.json") as f:
        report = json.load(f)
    with open(out / "serving.md") as f:
        assert f.read() == serving.markdown(report["rows"], report["meta"])
    return report


def test_paired_step_times_interleave_the_paths_and_time_each_alone():
    """Every run steps each path once, starting from another path each run, and each
    step's time is its own: a path that sleeps longer measures longer, whichever
    order it ran in."""
    calls = []

    def path(n):
        def fn(i):
            calls.append((n, i))
            time.sleep(0.001 if n == 0 else 0.02)

        return fn

    times = timing.paired_step_times([path(0), path(1)], iters=6, warmup=1, device=torch.device("cpu"))
    assert [len(t) for t in times] == [6, 6]
    assert calls[:2] == [(0, 0), (1, 0)], "the warm-up steps every path"
    runs = [calls[2 + 2 * i : 4 + 2 * i] for i in range(6)]
    assert [run[0][0] for run in runs] == [0, 1, 0, 1, 0, 1], "each run starts from another path"
    assert all(run[0][1] == run[1][1] == i for i, run in enumerate(runs))
    assert min(times[0]) >= 1.0 and min(times[1]) >= 20.0
    assert statistics.median(times[1]) > 5 * statistics.median(times[0])


def test_runs_on_one_cpu_rank_with_torchrecs_serving_path(tmp_path):
    """World size 1: every path but the graphed ones is timed, and TorchRec's sharded
    quantized model, given the same quantized rows, equals ours on the same batch."""
    report = _run(tmp_path, 1, "--batch-sizes", "4,16", "--quant", "int4")
    rows = {(r["batch_size"], r["path"]): r for r in report["rows"]}
    assert sorted(rows) == sorted((b, p) for b in (4, 16) for p in serving.PATHS)
    for b in (4, 16):
        for path in ("pgas eager", "torchrec quant", "float table_wise"):
            assert rows[b, path]["p50_ms"] > 0 and rows[b, path]["samples_per_s"] > 0, (b, path)
        for path in ("pgas graphed", "torchrec quant graphed"):
            assert rows[b, path]["p50_ms"] is None and rows[b, path]["note"] == "n/a: CUDA graphs need GPUs"
        assert rows[b, "pgas eager"]["vs_ours"] == 1.0
        assert f"batch {b}: pgas eager vs torchrec quant, max abs difference 0" in report["meta"]["checks"]
    assert report["meta"]["quant"] == "int4" and report["meta"]["world"] == 1


def test_runs_on_two_cpu_ranks(tmp_path):
    """World size 2: ours and the float model on both ranks; TorchRec's one-process
    path is said to need GPUs."""
    report = _run(tmp_path, 2, "--batch-sizes", "8")
    rows = {r["path"]: r for r in report["rows"]}
    assert rows["pgas eager"]["p50_ms"] > 0 and rows["float table_wise"]["p50_ms"] > 0
    assert rows["pgas eager"]["samples_per_s"] == pytest.approx(16 / (rows["pgas eager"]["p50_ms"] / 1e3))
    assert rows["torchrec quant"]["note"] == "n/a: TorchRec's one-process path drives GPUs only"


class _ReadBack(Exception):
    pass


def test_torchrecs_graphed_step_reads_no_lengths_back(monkeypatch):
    """``torchrec_graph``: TorchRec's serving path built from the batch's values and
    lengths with its per-feature id counts given (``length_per_key``) never computes
    them (on GPUs, a copy to pageable host memory that a capture refuses: their
    ``_safe_tolist``), and serves every batch as the unsharded quantized module does;
    a KJT without them computes them in TorchRec's split. Captured on GPUs only: here
    the "graph" is the step run eagerly."""
    from torchrec.distributed import global_settings
    from torchrec.sparse import jagged_tensor

    monkeypatch.setattr(global_settings, "PROPOGATE_DEVICE", global_settings.get_propogate_device())
    cpu = torch.device("cpu")
    cfg = Config(3, 64, 8, 5, 3, 0.0, 1)
    ebc = serving.float_tables(cfg, cpu)
    unsharded = serving.quantized(ebc, "int8")
    model = serving.torchrec_quant(ebc, "int8", 1, cpu)
    kjts = workload.batches(cfg, cpu, 3, 0)
    captured = []

    def graph(fn, *example, model):
        captured.append([t.clone() for t in example])
        return lambda *args: fn(*args)

    monkeypatch.setattr(serving, "_graph", graph)
    step = serving.torchrec_graph(model, kjts)
    assert len(captured) == 1 and torch.equal(captured[0][0], kjts[0].values())

    def read_back(tensor):
        raise _ReadBack()

    monkeypatch.setattr(jagged_tensor, "_safe_tolist", read_back)
    with torch.no_grad():
        for kjt in kjts:
            fresh = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())
            assert torch.equal(step(fresh), unsharded(kjt))
        with pytest.raises(_ReadBack):
            model(KeyedJaggedTensor(keys=kjts[0].keys(), values=kjts[0].values(), lengths=kjts[0].lengths()))


def test_torchrecs_graphed_step_needs_one_count_per_feature_for_every_batch():
    """A graph fixes the per-feature id counts TorchRec's split slices by: batches
    whose counts differ are refused before anything is captured."""
    keys = ["f0", "f1"]
    same = KeyedJaggedTensor(keys=keys, values=torch.arange(4), lengths=torch.tensor([1, 1, 1, 1]))
    other = KeyedJaggedTensor(keys=keys, values=torch.arange(4), lengths=torch.tensor([2, 1, 0, 1]))
    with pytest.raises(ValueError, match=r"batches \[1\] have other ids per feature than batch 0"):
        serving.torchrec_graph(torch.nn.Identity(), [same, other])
