"""The benchmark suite's harness: scenarios, the floor model, and a real (tiny) run on
two CPU processes that writes its JSON, markdown and plot. Speed itself is shown by
running the suite, never by a test."""

import dataclasses
import itertools
import json
import math
import os

import pytest
import torch
from dist_utils import run_ranks, torchrun, torchrun_ok
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor

import torchrec_pgas.benchmark.__main__ as bench
from torchrec_pgas.benchmark import profile, report, workload
from torchrec_pgas.benchmark.config import (
    CRITEO_ROWS,
    ROW_WISE_ABOVE,
    Config,
    batch_sweep,
    dlrm_config,
    scenarios,
    table_specs,
)
from torchrec_pgas.benchmark.floor import LINK_BANDWIDTH, MEMORY_BANDWIDTH, floor, link_chunks, traffic
from torchrec_pgas.benchmark.workload import batches, embedding_configs, module_plan, placement
from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder


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


def test_floor_keeps_its_memory_and_link_parts_apart_each_at_its_own_bandwidth():
    cfg = Config(tables=5, rows=10, dim=8, batch_size=7, ids_per_bag=3, ranks=3)
    t = traffic(cfg)
    parts = floor(cfg, copy_gbps=3000.0, link_gbps=150.0)
    fields = parts.fields()
    assert (fields["memory_bytes"], fields["link_bytes"]) == (t.memory_bytes, t.link_bytes)
    assert (fields["copy_gbps"], fields["link_gbps"]) == (3000.0, 150.0)
    assert math.isclose(fields["memory_ms"], t.memory_bytes / 3000.0 / 1e6)
    assert math.isclose(fields["link_ms"], t.link_bytes / 150.0 / 1e6)
    assert fields["floor_ms"] == max(fields["memory_ms"], fields["link_ms"]) == parts.floor_ms
    # Each part moves with its own bandwidth only.
    faster_link = floor(cfg, copy_gbps=3000.0, link_gbps=300.0)
    assert faster_link.memory_ms == parts.memory_ms and math.isclose(faster_link.link_ms, parts.link_ms / 2)
    faster_copy = floor(cfg, copy_gbps=6000.0, link_gbps=150.0)
    assert faster_copy.link_ms == parts.link_ms and math.isclose(faster_copy.memory_ms, parts.memory_ms / 2)
    assert json.loads(json.dumps(fields)) == fields  # a result row's fields
    with pytest.raises(ValueError, match=r"link part \(\d+ bytes on 3 ranks\) needs a positive link bandwidth"):
        floor(cfg, copy_gbps=3000.0, link_gbps=0.0)
    with pytest.raises(ValueError, match="positive copy bandwidth, got 0"):
        floor(cfg, copy_gbps=0, link_gbps=150.0)


def test_dlrm_tables_span_orders_of_magnitude_and_follow_the_placement_rule():
    for scale, ranks in ((1.0, 2), (0.25, 8), (1e-4, 2), (1e-4, 3)):
        cfg = dlrm_config(Config(dim=16, ranks=ranks), scale)
        specs = table_specs(cfg)
        rows = [s.rows for s in specs]
        assert len(specs) == cfg.tables == 26
        assert math.log10(max(rows) / min(rows)) >= 3, rows  # orders of magnitude apart
        assert rows == list(CRITEO_ROWS) if scale == 1.0 else max(rows) <= math.ceil(40e6 * scale)
        pooling = [s.ids_per_bag for s in specs]
        assert min(pooling) == 1 and max(pooling) == 100 and sum(p <= 3 for p in pooling) > len(pooling) / 2
        # Big tables (full size) row-wise, whatever the scale; the rest table-wise.
        assert [s.row_wise for s in specs] == [r > ROW_WISE_ABOVE for r in CRITEO_ROWS]
        assert sum(s.row_wise for s in specs) == 6
        # Table-wise tables balanced by lookup traffic: every rank gets some, and no
        # rank exceeds the lightest by more than one table's load.
        load = [0] * ranks
        for s in specs:
            if not s.row_wise:
                load[s.rank] += s.ids_per_bag * (16 * 4 + 8) + 16 * 4
        heaviest_table = max(s.ids_per_bag * (16 * 4 + 8) + 16 * 4 for s in specs if not s.row_wise)
        assert min(load) > 0 and max(load) - min(load) <= heaviest_table, load
        assert cfg.zipf_alpha == 1.05 and "zipf 1.05" in cfg.label() and "6 row-wise" in cfg.label()
    with pytest.raises(ValueError, match="scale must be in"):
        table_specs(dlrm_config(Config(), 0.0))
    with pytest.raises(ValueError, match="unknown table shape 'zipfian'"):
        table_specs(Config(shape="zipfian"))
    with pytest.raises(ValueError, match="batch sizes must be positive"):
        batch_sweep([Config()], [512, 0])
    assert [c.batch_size for c in batch_sweep(scenarios(Config(), 2)["dlrm"], [512, 65536])] == [512, 65536]


def test_mixed_plan_places_each_table_by_its_side_in_one_module():
    cfg = dlrm_config(Config(dim=8, ranks=2), 1e-4)
    specs = table_specs(cfg)
    ebc = EmbeddingBagCollection(tables=embedding_configs(cfg), device=torch.device("meta"))
    sharder = PgasEmbeddingBagCollectionSharder()
    for sharding, small, big in (
        ("pgas_table_wise+pgas_row_wise", "pgas_table_wise", "pgas_row_wise"),
        ("table_wise", "table_wise", "table_wise"),  # one type: every table
    ):
        plan = module_plan(cfg, sharding, ebc, "cpu", sharder)
        assert [plan[f"t{i}"].sharding_type for i in range(26)] == [big if s.row_wise else small for s in specs]
        assert all(plan[f"t{i}"].ranks == [s.rank] for i, s in enumerate(specs) if not s.row_wise)
        assert all(
            plan[f"t{i}"].ranks == [0, 1] for i, s in enumerate(specs) if s.row_wise and big.endswith("row_wise")
        )
    with pytest.raises(ValueError, match="unknown sharding 'table_wise\\+grid'"):
        placement("table_wise+grid", specs[0])


def test_zipf_ids_follow_the_law_scattered_over_the_table():
    cfg = Config(tables=2, rows=1000, batch_size=2000, ids_per_bag=20, zipf_alpha=1.05, ranks=1)
    kjt = batches(cfg, torch.device("cpu"), 1, rank=0)[0]
    p = [k**-1.05 for k in range(1, 1001)]
    for key in ("f0", "f1"):
        ids = kjt[key].values()
        assert ids.numel() == 40_000 and 0 <= int(ids.min()) and int(ids.max()) < 1000
        counts = torch.bincount(ids, minlength=1000).sort(descending=True).values.double() / ids.numel()
        for k in (0, 1, 9):  # the k-th hottest row's share, to within 5 standard deviations
            share = p[k] / sum(p)
            assert abs(counts[k] - share) < 5 * math.sqrt(share / ids.numel()), (key, k, float(counts[k]), share)
    hottest = [int(torch.bincount(kjt[k].values()).argmax()) for k in ("f0", "f1")]
    assert hottest[0] != hottest[1]  # each table scatters its hot rows its own way
    # Tables past torch.multinomial's 2^24 categories (Criteo's 40M rows at scale 1).
    big = Config(tables=1, rows=(1 << 24) + 1, batch_size=100, ids_per_bag=1, zipf_alpha=1.05, ranks=1)
    ids = batches(big, torch.device("cpu"), 1, rank=0)[0].values()
    assert ids.numel() == 100 and 0 <= int(ids.min()) and int(ids.max()) <= 1 << 24


def test_floor_of_a_mixed_plan_adds_each_placements_traffic():
    b, dim, row = 4, 8, 32
    cfg = dlrm_config(Config(dim=dim, batch_size=b, ranks=2), 1e-4)
    specs = table_specs(cfg)
    rw_ids = sum(s.ids_per_bag for s in specs if s.row_wise)
    rw = len([s for s in specs if s.row_wise])
    memory, link = [], []
    for r in range(2):
        mine = [s for s in specs if not s.row_wise and s.rank == r]
        theirs = [s for s in specs if not s.row_wise and s.rank != r]
        # Row-wise: half of all ranks' ids (each rank's own count) hit my rows; a partial
        # sum for every sample of both ranks; half my ids and one partial sum per sample out.
        memory.append(
            b * rw_ids * (row + 8)
            + rw * 2 * b * row
            + sum(2 * b * s.ids_per_bag * (row + 8) + 2 * b * row for s in mine)
        )
        link.append(
            b * rw_ids // 2 * 8 + rw * b * row + len(mine) * b * row + sum(b * s.ids_per_bag * 8 for s in theirs)
        )
    t = traffic(cfg)
    assert (t.memory_bytes, t.link_bytes) == (max(memory), max(link))
    single = traffic(dataclasses.replace(cfg, ranks=1))  # one rank does every lookup, sends nothing
    assert single.link_bytes == 0
    assert single.memory_bytes == sum(b * s.ids_per_bag * (row + 8) + b * row for s in specs)


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


#: A tiny workload's options, for the benchmark runs on two CPU processes.
TINY_RUN = ("--tables", "4", "--rows", "300", "--dim", "8", "--batch-size", "16", "--ids-per-bag", "3")


def test_suite_runs_on_two_cpu_processes_and_writes_its_report(tmp_path):
    out = str(tmp_path / "bench")
    suite = ("--suite", "r1,weak,zipf,large_tables", "--iters", "2", "--warmup", "1", "--rounds", "2")
    torchrun_ok("-m", "torchrec_pgas.benchmark", *suite, *TINY_RUN, "--out", out)
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
    assert all(r["options"] == {"sparse_update": "fused", "remote_path": "auto", "headroom": 2.0} for r in rows)
    table = open(os.path.join(out, "results.md")).read()
    assert table.count("pgas_table_wise vs table_wise") == 5 and "rounds" in table
    assert f"{host['alloc_us']:.1f} us per small allocation" in table.splitlines()[0]
    assert f"{rows[0]['link_ms']:.3f} at {rows[0]['link_gbps']:.0f} GB/s" in table
    assert os.path.getsize(os.path.join(out, "speedup.png")) > 0


def test_profile_runs_on_two_cpu_processes_and_writes_its_profiles(tmp_path):
    out = str(tmp_path / "prof")
    stdout = torchrun_ok("-m", "torchrec_pgas.benchmark.profile", *TINY_RUN, "--iters", "3", "--out", out)
    timed = [line.split()[:2] for line in stdout.splitlines() if "step_ms" in line]
    assert timed == [[s, step] for s in ("pgas_table_wise", "table_wise") for step in ("forward", "train_step")]
    for s in ("pgas_table_wise", "table_wise"):
        with open(os.path.join(out, f"cprofile_{s}_forward.txt")) as f:
            assert "Ordered by: cumulative time" in f.read()
        for step, rank in itertools.product(("forward", "train_step"), (0, 1)):
            assert os.path.getsize(os.path.join(out, f"torch_profile_{s}_{step}.txt")) > 0
            with open(os.path.join(out, f"torch_profile_{s}_{step}_rank{rank}.json")) as f:
                assert json.load(f)["traceEvents"], (s, step, rank)


def test_dlrm_batch_sweep_runs_on_two_cpu_processes_and_compares_outputs(tmp_path):
    out = str(tmp_path / "dlrm")
    args = ["-m", "torchrec_pgas.benchmark", "--suite", "r1,dlrm", "--scale", "1e-4", "--batch-sizes", "16,40"]
    args += ["--tables", "3", "--rows", "200", "--dim", "8", "--ids-per-bag", "3", "--iters", "2", "--warmup", "1"]
    stdout = torchrun_ok(*args, "--out", out)
    # TorchRec's row_wise is GPU only: on CPUs the big tables meet its table_wise, and the run says so.
    assert "TorchRec offers no row_wise on cpu" in stdout
    with open(os.path.join(out, "results.json")) as f:
        rows = json.load(f)["rows"]
    assert [(r["scenario"], r["short"], r["config"]["batch_size"]) for r in rows] == [
        ("r1", "16", 16),
        ("r1", "40", 40),
        ("dlrm", "16", 16),
        ("dlrm", "40", 40),
    ]
    r1, dlrm = rows[:2], rows[2:]
    assert all(r["identical"] and r["pair"] == ["table_wise", "pgas_table_wise"] for r in r1)
    for r in dlrm:
        assert r["pair"] == ["table_wise", "pgas_table_wise+pgas_row_wise"] and r["config"]["shape"] == "dlrm"
        # Tables both sides place table-wise: bit for bit; ours row-wise against their
        # table-wise: the same sums in another order (weights within 0.01, up to 100 ids).
        assert r["max_diff_by_placement"]["table_wise"] == 0.0, r["max_diff_by_placement"]
        assert r["max_diff_by_placement"]["row_wise"] < 1e-5, r["max_diff_by_placement"]
        assert r["max_diff"] == max(r["max_diff_by_placement"].values())
        assert all(r["ours"][k] > 0 and r["baseline"][k] > 0 for k in ("forward_ms", "dlrm_ms", "train_ms"))
    # The floor's parts, from the mixed plan's traffic at the run's bandwidths.
    for r in rows:
        t = traffic(Config(**r["config"]))
        assert math.isclose(r["memory_ms"], t.memory_bytes / r["copy_gbps"] / 1e6)
        assert math.isclose(r["link_ms"], t.link_bytes / r["link_gbps"] / 1e6)
        assert r["floor_ms"] == max(r["memory_ms"], r["link_ms"]) > 0
    assert dlrm[1]["memory_ms"] > dlrm[0]["memory_ms"] > r1[0]["memory_ms"]  # 26 tables, up to 100 ids
    table = open(os.path.join(out, "results.md")).read()
    assert table.count("pgas_table_wise+pgas_row_wise vs table_wise") == 2 and "DLRM-shaped 26 tables" in table
    assert os.path.getsize(os.path.join(out, "speedup.png")) > 0


def test_cuda_graph_option_parses_with_the_batch_sweep_and_refuses_cpus(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    sweep = "512,1024,2048,4096,8192,16384,32768,65536"
    args = bench._parse(["--cuda-graph", "--suite", "r1,dlrm", "--batch-sizes", sweep])
    assert args.cuda_graph and args.batch_sizes == [512 << k for k in range(8)]
    assert not bench._parse([]).cuda_graph
    configs = batch_sweep(scenarios(Config(), 1)["r1"] + scenarios(Config(), 1)["dlrm"], args.batch_sizes)
    assert [c.batch_size for c in configs] == args.batch_sizes * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refusal = "--cuda-graph needs GPUs (it captures CUDA graphs), and torch sees no CUDA device here"
    with pytest.raises(SystemExit):
        bench._parse(["--cuda-graph"])
    assert refusal in capsys.readouterr().err
    monkeypatch.undo()
    if torch.cuda.is_available():
        return
    # The launched benchmark stops at its arguments, before any process group: no rank
    # waits for another.
    done = torchrun("-m", "torchrec_pgas.benchmark", "--cuda-graph", *TINY_RUN, "--out", "unused")
    assert done.returncode != 0 and refusal in done.stderr


def _fake_rounds():
    """Three rounds of (TorchRec, ours) times; ours with graphed times."""
    base = [{"forward_ms": f, "dlrm_ms": 4.0, "train_ms": 6.0} for f in (3.0, 2.0, 4.0)]
    ours = [
        {
            "forward_ms": 1.0,
            "dlrm_ms": 2.0,
            "train_ms": 3.0,
            "forward_graphed_ms": g,
            "dlrm_graphed_ms": 1.0,
            "train_graphed_ms": 2.5,
        }
        for g in (0.5, 0.4, 0.5)
    ]
    return list(zip(base, ours))


def _fake_row(short: str, pair, rounds, graphed_diff=None):
    row = {
        "scenario": "r1",
        "label": f"1 ranks, 8 x 1000000 x 128, {short}/rank",
        "short": short,
        "config": {},
        "pair": list(pair),
        **report.summarize(rounds),
        "identical": True,
        "max_diff": 0.0,
        "floor_ms": 0.1,
    }
    if graphed_diff is not None:
        row["baseline_graphed"] = bench.TORCHREC_NOT_GRAPHED
        row["graphed_max_diff"] = graphed_diff
    return row


def test_graphed_times_are_reported_next_to_eager_and_torchrecs(tmp_path, monkeypatch, capsys):
    rounds = _fake_rounds()
    summary = report.summarize(rounds)
    assert summary["baseline"] == {"forward_ms": 3.0, "dlrm_ms": 4.0, "train_ms": 6.0}
    assert summary["ours"]["forward_graphed_ms"] == 0.5 and summary["ours"]["train_graphed_ms"] == 2.5
    # Every ratio divides TorchRec's eager time of the same round.
    assert summary["speedup_per_round"]["forward_graphed_ms"] == [6.0, 5.0, 8.0]
    assert summary["speedup_per_round"]["forward_ms"] == [3.0, 2.0, 4.0]
    assert summary["speedup_per_round"]["train_graphed_ms"] == [6.0 / 2.5] * 3
    eager_only = [(b, {k: v for k, v in o.items() if "graphed" not in k}) for b, o in rounds]
    rows = [
        _fake_row("512", ("table_wise", "pgas_table_wise"), rounds, graphed_diff=0.0),
        _fake_row("65536", ("table_wise", "pgas_table_wise"), rounds[:1], graphed_diff=1e-6),
        _fake_row("512", ("row_wise", "pgas_row_wise"), eager_only),  # no graphed times: eager table only
    ]
    out = str(tmp_path / "graphed")
    drawn = {}
    import matplotlib.figure

    def savefig(fig, path, **kwargs):
        drawn.update({line.get_label(): list(line.get_ydata()) for ax in fig.axes for line in ax.get_lines()})

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    report.write(rows, {"hardware": "1 x H200", "iters": 50, "rounds": 3, "command": "c"}, out)
    printed = capsys.readouterr().out
    table = open(os.path.join(out, "results.md")).read()
    assert table in printed  # the ratios are printed as well as written
    eager, graphed = table.split("CUDA graphs (`--cuda-graph`)")
    assert eager.count("pgas_table_wise vs table_wise") == 2 and "pgas_row_wise vs row_wise" in eager
    assert "3.000 / 1.000 (**3.00x**, rounds 2.00-4.00x)" in eager
    # TorchRec eager / ours eager / ours graphed, TorchRec eager over ours graphed and the graph's own gain.
    assert "3.000 / 1.000 / 0.500 (**6.00x**, rounds 5.00-8.00x, graphs 2.00x)" in graphed
    assert "6.000 / 3.000 / 2.500 (**2.40x**, rounds 2.40-2.40x, graphs 1.20x)" in graphed
    assert "4.000 / 2.000 / 1.000 (**4.00x**" in graphed
    assert "3.000 / 1.000 / 0.500 (**6.00x**, graphs 2.00x)" in graphed  # one round: no spread
    assert f"table_wise: {bench.TORCHREC_NOT_GRAPHED}" in graphed and "SplitsAllToAllAwaitable" in graphed
    assert "| identical to eager |" in graphed and "| max diff 1.0e-06 from eager |" in graphed
    assert "pgas_row_wise" not in graphed
    with open(os.path.join(out, "results.json")) as f:
        saved = json.load(f)["rows"]
    assert saved[0]["ours"]["dlrm_graphed_ms"] == 1.0 and "forward_graphed_ms" not in saved[0]["baseline"]
    assert saved[0]["baseline_graphed"].startswith("n/a: ") and "baseline_graphed" not in saved[2]
    # The plot: a graphed line next to each eager one, against the same eager TorchRec time.
    assert drawn["embedding forward graphed, pgas_table_wise"] == [6.0, 6.0]
    assert drawn["embedding forward, pgas_table_wise"] == [3.0, 3.0]
    assert drawn["training step graphed, pgas_table_wise"] == [2.4, 2.4]
    assert drawn["DLRM inference, pgas_row_wise"] == [2.0] and "DLRM inference graphed, pgas_row_wise" not in drawn
    assert not any("graphed" in line for line in report.markdown(rows[2:], "h").splitlines())


def _options_reach_the_sharding(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from torchrec_pgas.benchmark.config import options_record, pgas_options
    from torchrec_pgas.types import PgasOptions

    args = bench._parse(["--sparse-update", "fbgemm", "--remote-path", "put", "--headroom", "1"])
    cfg = dataclasses.replace(Config(), tables=2, rows=64, batch_size=8, ranks=world_size)
    cpu, pg = torch.device("cpu"), dist.group.WORLD
    model = workload.build(cfg, "pgas_table_wise", cpu, pg, options=pgas_options(args))
    assert model.module.ebc._pgas_options == PgasOptions(sparse_update="fbgemm", remote_path="put", headroom=1.0)
    assert options_record(pgas_options(args)) == {"sparse_update": "fbgemm", "remote_path": "put", "headroom": 1.0}
    assert workload.build(cfg, "pgas_table_wise", cpu, pg).module.ebc._pgas_options == PgasOptions()
    # The workload's optimizer trains both sides: row-wise Adagrad keeps a momentum per table.
    adagrad = dataclasses.replace(cfg, optimizer=bench._parse(["--optimizer", "rowwise_adagrad"]).optimizer)
    for sharding in ("table_wise", "pgas_table_wise", "row_wise", "pgas_row_wise"):
        for config, state in ((cfg, []), (adagrad, ["momentum1"])):
            built = workload.build(config, sharding, cpu, pg).fused_optimizer.state_dict()["state"]
            assert [sorted(k.split(".")[-1] for k in v) for v in built.values()] == [state] * 2, sharding


def test_options_reach_our_sharding(capsys):
    """``--sparse-update``, ``--remote-path`` and ``--headroom`` (defaults:
    ``PgasOptions``') are the options our side's modules are built with, in the
    benchmark and its profile, and ``--optimizer`` trains both sides; other values are
    refused."""
    assert (bench._parse([]).sparse_update, bench._parse([]).remote_path) == ("fused", "auto")
    assert profile._parse(["--sparse-update", "fbgemm"]).sparse_update == "fbgemm"
    assert profile._parse(["--remote-path", "put"]).remote_path == "put"
    assert bench._parse([]).optimizer == "sgd" and profile._parse(["--optimizer", "rowwise_adagrad"])
    assert profile._parse(["--headroom", "1.5"]).headroom == 1.5 and bench._parse([]).headroom == 2.0
    for bad in (["--sparse-update", "adam"], ["--remote-path", "ib"], ["--optimizer", "adam"]):
        with pytest.raises(SystemExit):
            bench._parse(bad)
        assert f"invalid choice: '{bad[1]}'" in capsys.readouterr().err
    for bad, why in (("0.5", "must be a number from 1 to"), ("nan", "must be a number"), ("x", "could not convert")):
        with pytest.raises(SystemExit):
            profile._parse(["--headroom", bad])
        assert "argument --headroom: " in (err := capsys.readouterr().err) and why in err
    run_ranks(_options_reach_the_sharding, 1)


def _graphed_pair(rank: int, world_size: int, out: str) -> None:
    """``_run`` with ``--cuda-graph`` on CPU ranks, a stand-in for
    ``torchrec_pgas.graphs.capture`` running each captured step eagerly, as the real
    one replays it: inputs of the example's sizes in, outputs of the step out."""
    import sys
    import types

    import torch.distributed as dist

    captured, checked = [], []

    def capture(fn, *example, warmup=3, model=None):
        assert isinstance(model, torch.nn.Module), "a function's model is named (graphs.capture)"
        captured.append(fn)
        sizes = lambda args: [a.values().shape if isinstance(a, KeyedJaggedTensor) else a.shape for a in args]  # noqa: E731

        def replay(*args):
            assert sizes(args) == sizes(example), "a graph's inputs keep their sizes"
            return fn(*args)

        return replay

    def raise_errors(model, wait=False):
        checked.append(wait)

    sys.modules["torchrec_pgas.graphs"] = types.SimpleNamespace(capture=capture, raise_errors=raise_errors)
    cfg = Config(tables=3, rows=50, dim=8, batch_size=6, ids_per_bag=3, ranks=world_size)
    args = bench._parse(["--iters", "2", "--warmup", "1", "--rounds", "2"])
    args.cuda_graph = True  # (the parser refuses it without a GPU)
    rows = bench._run("r1", cfg, dist.group.WORLD, torch.device("cpu"), {}, args)
    assert len(captured) == 2 * 3, "ours only, each round: forward, training step, DLRM inference"
    assert checked == [True] * 6, "each graph's replays end with a wait for their errors"
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def test_cuda_graph_run_times_ours_graphed_and_compares_replays_with_eager(tmp_path):
    out = str(tmp_path / "rows.json")
    run_ranks(_graphed_pair, 2, out=out)
    with open(out) as f:
        (row,) = json.load(f)
    assert row["pair"] == ["table_wise", "pgas_table_wise"] and row["identical"]
    assert set(row["baseline"]) == {"forward_ms", "train_ms", "dlrm_ms"}
    assert set(row["ours"]) == {
        "forward_ms",
        "train_ms",
        "dlrm_ms",
        "forward_graphed_ms",
        "train_graphed_ms",
        "dlrm_graphed_ms",
    }
    assert all(v > 0 for v in row["ours"].values())
    assert all(len(row["speedup_per_round"][k]) == 2 for k in row["ours"])
    assert row["baseline_graphed"] == bench.TORCHREC_NOT_GRAPHED
    # The replay's outputs against the eager step's, on the same batch and weights.
    assert row["graphed_max_diff"] == 0.0


def test_report_puts_the_floors_parts_in_columns_of_their_own_and_names_their_bandwidths():
    eager = [(b, {k: v for k, v in o.items() if "graphed" not in k}) for b, o in _fake_rounds()]
    two = _fake_row("8192", ("table_wise", "pgas_table_wise"), eager)
    two.update(floor(Config(ranks=2), copy_gbps=4000.0, link_gbps=160.0).fields())
    one = _fake_row("1024", ("table_wise", "pgas_table_wise"), eager)
    one.update(floor(Config(ranks=1, batch_size=1024), copy_gbps=4000.0, link_gbps=0.0).fields())
    table = report.markdown([two, one], "h")
    lines = table.splitlines()
    columns = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert columns[-4:] == ["floor ms", "memory part ms", "link part ms", "ours / floor"]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[4:6]]
    assert all(len(c) == len(columns) for c in cells)
    assert cells[0][-4:] == [
        f"{two['floor_ms']:.3f}",
        f"{two['memory_ms']:.3f} at 4000 GB/s",
        f"{two['link_ms']:.3f} at 160 GB/s",
        f"{1.0 / two['floor_ms']:.1f}x",
    ]
    assert cells[1][-3:-1] == [f"{one['memory_ms']:.3f} at 4000 GB/s", "0 (one rank)"]
    # The legend says which bandwidth each part is taken at: the link's from device-initiated multi-block puts.
    assert report.FLOOR_LEGEND in table and MEMORY_BANDWIDTH in table and LINK_BANDWIDTH in table
    assert "device-initiated" in LINK_BANDWIDTH and "32 rows of put_signal's blocks" in LINK_BANDWIDTH


RESULTS = os.path.join(os.path.dirname(__file__), "..", "examples", "benchmark_results")


def _stored_results():
    """The stored results of the benchmark's pairs (a soak's file has other keys, the
    serving benchmark's rows are per path)."""

    def pairs(name: str) -> bool:
        rows, _ = report.load(os.path.join(RESULTS, name))
        return bool(rows) and all("baseline" in r for r in rows)

    return sorted(f for f in os.listdir(RESULTS) if f.endswith(".json") and pairs(f))


@pytest.mark.parametrize("name", _stored_results())
def test_every_stored_result_renders_again_whatever_fields_its_version_kept(name, tmp_path, monkeypatch):
    """Results of earlier versions lack the floor's parts (a host-issued put's
    bandwidth instead), the graphed times, or (hand-copied rows) the comparison."""
    monkeypatch.setattr(report, "plot", lambda rows, path: open(path, "wb").close())
    rows, _ = report.load(os.path.join(RESULTS, name))
    report.main([os.path.join(RESULTS, name), "--out", str(tmp_path)])
    table = open(tmp_path / "results.md").read()
    lines = [line for line in table.splitlines() if line.startswith("| ") and " vs " in line]
    assert len(lines) == len(rows) + len([r for r in rows if "forward_graphed_ms" in r["ours"]])
    assert all(len(line.split("|")) == len(table.splitlines()[2].split("|")) for line in lines[: len(rows)])
    for r, line in zip(rows, lines):
        if "memory_ms" in r:
            assert f"{r['memory_ms']:.3f} at {r['copy_gbps']:.0f} GB/s" in line
        elif r.get("put_gbps"):
            assert f"n/a (run measured a host-issued put, {r['put_gbps']:.0f} GB/s)" in line


def test_report_refuses_a_results_file_without_rows(tmp_path):
    empty = tmp_path / "results.json"
    empty.write_text(json.dumps({"meta": {}, "rows": []}))
    with pytest.raises(SystemExit, match="no result rows to render"):
        report.main([str(empty)])


def _run_rows(times, graphed=True, extra=()):
    """Rows of a sweep: per batch size ``short``, TorchRec's and our times (ms)."""
    rows = []
    for short, (theirs, ours) in times.items():
        for pair in (("table_wise", "pgas_table_wise"), ("row_wise", "pgas_row_wise")):
            mine = {"forward_ms": ours, "train_ms": 2 * ours}
            if graphed:
                mine["forward_graphed_ms"] = ours / 2
            rows.append(
                {
                    "scenario": "r1",
                    "short": short,
                    "pair": list(pair),
                    "baseline": {"forward_ms": theirs, "train_ms": 2 * theirs},
                    "ours": mine,
                }
            )
    return rows + list(extra)


def test_report_compares_runs_on_the_configurations_they_share(tmp_path, capsys):
    """Several results files: one line per configuration and pair every run has, each
    measurement's speed-up in each run in the labels' order (graphed where a run has
    it, n/a where not); the plot is drawn; runs that share nothing, or labels that do
    not name every run, are refused."""
    g = torch.Generator().manual_seed(11)
    sizes = ["512", "8192", "65536"]
    before = {s: (1.0 + float(torch.rand((), generator=g)), 0.5 + float(torch.rand((), generator=g))) for s in sizes}
    after = {s: (before[s][0], before[s][1] * 0.8) for s in sizes[1:]}  # no 512 run
    extra = [dict(_run_rows({"9": (1.0, 1.0)})[0], scenario="dlrm")]  # only in the first run
    paths = []
    for name, rows in (("before", _run_rows(before, extra=extra)), ("after", _run_rows(after, graphed=False))):
        (tmp_path / name).mkdir()
        paths.append(str(tmp_path / name / "results.json"))
        with open(paths[-1], "w") as f:
            json.dump({"meta": {}, "rows": rows}, f)
    report.main(paths + ["--out", str(tmp_path / "cmp")])
    table = open(tmp_path / "cmp" / "compare.md").read()
    assert table == capsys.readouterr().out.rstrip("\n") + "\n"
    assert table.startswith("TorchRec's eager time over ours, per run: before / after")
    lines = [line for line in table.splitlines() if line.startswith("| r1 ")]
    assert len(lines) == 4 and "dlrm" not in table and "| 512 |" not in table
    for line, (short, pair) in zip(lines, [(s, p) for s in sizes[1:] for p in ("table_wise", "row_wise")]):
        theirs, ours = before[short]
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[:3] == ["r1", short, f"pgas_{pair} vs {pair}"]
        assert cells[3] == f"{theirs / ours:.2f}x / {theirs / (ours * 0.8):.2f}x"  # forward
        assert cells[4] == f"{theirs / (ours / 2):.2f}x / n/a"  # forward graphed: the first run's only
        assert cells[5] == f"{theirs / ours:.2f}x / {theirs / (ours * 0.8):.2f}x"  # training
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    report.main(paths[::-1] + ["--labels", "new,old"])
    assert capsys.readouterr().out.startswith("TorchRec's eager time over ours, per run: new / old")
    with pytest.raises(SystemExit, match="--labels names 1 runs, 2 results files given"):
        report.main(paths + ["--labels", "one"])
    lone = tmp_path / "lone.json"
    lone.write_text(json.dumps({"meta": {}, "rows": extra}))
    with pytest.raises(SystemExit, match="share no configuration and pair"):
        report.main([paths[1], str(lone)])


def test_profile_cuda_graph_option_parses_with_batch_sizes_and_refuses_cpus(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = profile._parse(["--cuda-graph", "--batch-sizes", "1024,8192", "--replays", "7", "--warmup", "0"])
    assert args.cuda_graph and args.batch_sizes == [1024, 8192] and args.replays == 7 and args.warmup == 0
    assert args.shardings == "pgas_table_wise,table_wise" and not profile._parse([]).cuda_graph
    for bad, message in ((["--replays", "0"], "--replays must be at least 1, got 0"), (["--warmup", "-1"], "-1")):
        with pytest.raises(SystemExit):
            profile._parse(["--cuda-graph", *bad])
        assert message in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        profile._parse(["--cuda-graph"])
    assert "--cuda-graph needs GPUs" in capsys.readouterr().err
    assert profile.graphable("pgas_table_wise") and profile.graphable("pgas_table_wise+pgas_row_wise")
    assert not profile.graphable("table_wise") and not profile.graphable("pgas_table_wise+row_wise")


def _trace():
    """Two marked steps of a synthetic chrome trace (us): kernels of a graph replay
    (one launch), a copy that runs after its step's mark ended, overlapping kernels, a
    fill without a launch in the trace, and a barrier's kernel between steps."""

    def mark(i, ts):
        return {"ph": "X", "cat": "user_annotation", "name": f"{profile.STEP_MARK} {i}", "ts": ts, "dur": 50}

    def launch(corr, ts):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunch",
            "ts": ts,
            "dur": 2,
            "args": {"correlation": corr},
        }

    def device(cat, name, ts, dur, corr=None):
        args = {} if corr is None else {"correlation": corr}
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    return [
        {"ph": "M", "name": "process_name", "ts": 0, "args": {"name": "python"}},
        device("kernel", "nccl_barrier", 95, 3, corr=9),
        launch(9, 90),
        mark(1, 200),  # marks in any order
        mark(0, 100),
        {"ph": "X", "cat": "gpu_user_annotation", "name": f"{profile.STEP_MARK} 0", "ts": 110, "dur": 60},
        launch(1, 105),  # cudaGraphLaunch: every kernel of the replay
        device("kernel", "a", 110, 10, corr=1),
        device("kernel", "b", 125, 5, corr=1),
        device("kernel", "c", 128, 6, corr=1),  # overlaps b (another stream)
        launch(2, 120),
        device("gpu_memcpy", "Memcpy DtoD", 160, 4, corr=2),  # after the mark: its launch decides
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 130, "dur": 5},
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 120, "id": 2},
        launch(3, 205),
        device("kernel", "a", 210, 12, corr=3),
        device("gpu_memset", "Memset", 230, 1),
    ]


def test_device_profile_assigns_each_kernel_to_its_step_and_finds_the_idle_gaps():
    steps = profile.step_activities(_trace())
    assert [[a.name for a in s] for s in steps] == [["a", "b", "c", "Memcpy DtoD"], ["a", "Memset"]]
    first, second = profile.device_step(steps[0]), profile.device_step(steps[1])
    # 110..164; busy: a 10, b and c together 125..134 = 9, the copy 4; idle: the gaps.
    assert (first.span_us, first.busy_us, first.kernel_us, first.idle_us) == (54, 23, 25, 31)
    assert (second.span_us, second.busy_us, second.kernel_us, second.idle_us) == (21, 13, 13, 8)
    assert profile.device_step([]) == profile.DeviceStep(0.0, 0.0, 0.0, 0)
    table = profile.kernel_table(steps)
    assert [(k.name, k.count, k.total_us) for k in table] == [
        ("a", 2, 22.0),
        ("c", 1, 6.0),
        ("b", 1, 5.0),
        ("Memcpy DtoD", 1, 4.0),
        ("Memset", 1, 1.0),
    ]
    assert table[0].mean_us == 11.0
    parts = floor(Config(tables=2, rows=10, dim=4, batch_size=5, ids_per_bag=3, ranks=1), 0.01, 0.0)
    p = profile.summarize_steps("pgas_table_wise", 5, "graphed", 0.1, steps, [0.09, 0.05], parts)
    # The timeline of one step, that of median span (the lower of two): its parts add up.
    assert (p.step_us, p.steps, p.span_us, p.busy_us, p.kernel_us, p.idle_us) == (100.0, 2, 21.0, 13.0, 13.0, 8.0)
    assert p.profiled_step_us == 50.0 and p.outside_us == 29.0 and p.per_step_us(table[0]) == 11.0
    assert math.isclose(p.memory_floor_us, parts.memory_bytes / 0.01 / 1e3)
    assert math.isclose(p.copy_share(table[0]), p.memory_floor_us / 11.0)
    text = profile.summary_markdown([p], "h")
    summary = text.split("### Summary (us per step)")[1]  # last, where a run's output ends
    line = f"| pgas_table_wise | 5 | graphed | 100.0 | 50.0 | 21.0 | 13.0 | 8.0 | 29.0 | {p.memory_floor_us:.1f} |"
    assert line in summary
    assert f"`a` 11.0, {100 * p.copy_share(table[0]):.0f}% | 3 |" in summary  # 6 activities over 2 steps
    section = text.split("### pgas_table_wise, 5 samples per rank, graphed")[1].split("### Summary")[0]
    assert "| `a` | 1 | 11.0 | 11.0 | 58% |" in section and "| `Memset` | 0.5 | 0.5 | 1.0 | 3% |" in section
    assert "idle 8.0 us inside the span" in section and "no link part (one rank)" in section
    # The note's sentence: a step of median span has a and Memset; the others over both steps.
    share = f"{100 * p.copy_share(table[0]):.0f}%"
    gist = f"`a` 11.0 us of 50.0 (at {share} of copy bandwidth); 2 other kernels 4.0 us each; idle 8.0 us"
    assert gist in section, section
    empty = profile.summarize_steps("table_wise", 5, "eager", 0.2, [[], []], [0.3, 0.4], parts)
    assert empty.steps == 0 and not empty.kernels and "no device activity" in profile.profile_markdown(empty)
    assert "| table_wise | 5 | eager | 200.0 | 0.0 | 0.0 |" in profile.summary_markdown([empty], "h")
    with pytest.raises(ValueError, match="2 marked steps in the trace, 3 timed"):
        profile.summarize_steps("table_wise", 5, "eager", 0.2, steps, [0.1] * 3, parts)


def test_device_profile_names_the_rest_of_many_kernels_together():
    steps = [[profile.Activity(f"k{i:02d}", 10.0 * i, 1.0 + i) for i in range(profile.TOP_KERNELS + 3)]]
    p = profile.summarize_steps("s", 1, "eager", 1.0, steps, [1.0], floor(Config(ranks=1), 1000.0, 0.0))
    section = profile.profile_markdown(p)
    assert "`k14`" in section and "`k02`" not in section  # longest first
    assert "| 3 others | 3 | 6.0 | 2.0 |" in section  # k00..k02: 1 + 2 + 3 us


def _graph_profile_ranks(rank: int, world_size: int, out: str) -> None:
    """``--cuda-graph``'s whole run on CPU ranks: a stand-in for ``graphs.capture``
    replaying the step eagerly, and the host's operators standing in for kernels
    (a CPU trace has no device activity)."""
    import functools
    import sys
    import types

    captured = []

    def capture(fn, *example, warmup=3, model=None):
        assert isinstance(model, torch.nn.Module)
        captured.append(fn)
        return fn

    sys.modules["torchrec_pgas.graphs"] = types.SimpleNamespace(
        capture=capture, raise_errors=lambda m, wait=False: None
    )
    profile.step_activities = functools.partial(profile.step_activities, categories=("cpu_op",))
    args = profile._parse([*TINY_RUN, "--batch-sizes", "16,40", "--iters", "2", "--warmup", "1", "--replays", "3"])
    args.cuda_graph, args.out = True, out
    profile.graph_main(args, torch.device("cpu"))
    assert len(captured) == 2, "pgas_table_wise at each batch size; TorchRec's sharding is not captured"


def test_profile_cuda_graph_mode_runs_on_two_cpu_processes_and_writes_its_summary(tmp_path):
    out = str(tmp_path / "graph")
    os.makedirs(out)
    run_ranks(_graph_profile_ranks, 2, out=out)
    with open(os.path.join(out, "graph_profile.json")) as f:
        results = json.load(f)
    found = [(p["sharding"], p["batch_size"], p["mode"]) for p in results["profiles"]]
    assert found == [
        (s, b, m)
        for b in (16, 40)
        for s, modes in (("pgas_table_wise", ("eager", "graphed")), ("table_wise", ("eager",)))
        for m in modes
    ]
    for p in results["profiles"]:
        assert p["steps"] == 3 and p["step_us"] > 0 and p["kernels"], p
        assert p["profiled_step_us"] >= p["span_us"] and math.isclose(
            p["outside_us"], p["profiled_step_us"] - p["span_us"]
        )
        assert 0 < p["busy_us"] <= min(p["span_us"], p["kernel_us"]) and math.isclose(
            p["idle_us"], p["span_us"] - p["busy_us"]
        )
        lookups = [k["count"] for k in p["kernels"] if k["name"].startswith("fbgemm::split_embedding_codegen_lookup")]
        assert lookups == [3], "one FBGEMM lookup in each profiled step, none from outside them"
        cfg = Config(tables=4, rows=300, dim=8, batch_size=p["batch_size"], ids_per_bag=3, ranks=2)
        assert p["floor"]["memory_bytes"] == traffic(cfg).memory_bytes and p["floor"]["link_bytes"] > 0
        name = f"{p['sharding']}_{p['batch_size']}_{p['mode']}"
        assert os.path.getsize(os.path.join(out, f"graph_kernels_{name}.txt")) > 0
        for rank in (0, 1):
            with open(os.path.join(out, f"graph_trace_{name}_rank{rank}.json")) as f:
                assert json.load(f)["traceEvents"]
    table = open(os.path.join(out, "graph_profile.md")).read()
    summary = table.split("### Summary (us per step)")[1]
    assert (
        len(
            [
                line
                for line in summary.splitlines()
                if line.startswith("| pgas_table_wise") or line.startswith("| table_wise")
            ]
        )
        == 6
    )
    assert "Not graphed (TorchRec's sharding cannot be captured): table_wise." in table.splitlines()[0]


def test_floor_bandwidths_print_what_each_was_measured_with():
    lines = [line for line in torchrun_ok("-m", "torchrec_pgas.benchmark.floor").splitlines() if "MiB: copy" in line]
    assert [line.split()[0] for line in lines] == ["16", "64", "256"]
    # CPU processes: the host transport's put (GPUs: device-initiated multi-block put+signal).
    assert all("GB/s, host transport put" in line and float(line.split()[-4]) > 0 for line in lines), lines


NCU_CSV = """==PROF== Connected to process 1234 (python3)
profiled one train step of table_wise: ...
"ID","Process ID","Kernel Name","Context","dram__bytes_read.sum","dram__bytes_write.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum"
"","","","","Mbyte","Kbyte","%","usecond"
"0","1234","lookup_put_kernel","1","1,250.5","300","73.6","1,506.6"
"1","1234","row_update_kernel","1","20","0.5","55.1","3.25"
==PROF== Disconnected from process 1234
"""


def test_nsight_table_reads_ncu_raw_csv_in_its_units():
    """Nsight Compute's raw CSV, with the program's own lines around it: one row per
    launch in launch order, each metric scaled from the unit its column gives to the
    table's (us, MB, %), and the total time; text without the CSV is refused."""
    from torchrec_pgas.benchmark import nsight

    lines = nsight.table(NCU_CSV).splitlines()
    assert lines[0] == "| kernel | us | DRAM % | read MB | written MB |"
    assert lines[2] == "| `lookup_put_kernel` | 1506.6 | 73.6 | 1250.5 | 0.3 |"
    assert lines[3] == "| `row_update_kernel` | 3.2 | 55.1 | 20.0 | 0.0 |"
    assert lines[-1] == "total 1509.8 us"
    # Without a units' row: base units (ns, bytes).
    base = "\n".join(line for line in NCU_CSV.splitlines() if '"Mbyte"' not in line)
    assert "| `lookup_put_kernel` | 1.5 | 73.6 | 0.0 | 0.0 |" in nsight.table(base)
    # Nsight Compute 2025.3 (the device machine's) prints times in "ns".
    short = NCU_CSV.replace('"usecond"', '"ns"')
    assert "| `lookup_put_kernel` | 1.5 | 73.6 | 1250.5 | 0.3 |" in nsight.table(short)
    with pytest.raises(ValueError, match="gpu__time_duration.sum is in 'fortnight'"):
        nsight.table(NCU_CSV.replace('"usecond"', '"fortnight"'))
    with pytest.raises(ValueError, match="Kernel Name"):
        nsight.table("==PROF== nothing profiled\n")


def _nsight_steps(rank, world_size):
    """Each sharding's one step runs between the range's start and stop, after its
    warm-up steps, one sharding after the other; the DLRM-shaped scenario takes its
    own tables at the given scale."""
    from torchrec_pgas.benchmark import nsight

    args = nsight._parse([*TINY_RUN, "--warmup", "2"])
    events = []
    steps = workload.steps

    def recorded_steps(model, kjts, grads):
        forward, train_step = steps(model, kjts, grads)
        return forward, lambda i: (events.append(("train", i)), train_step(i))

    workload.steps = recorded_steps
    shardings = nsight.profile_steps(
        args, torch.device("cpu"), lambda: events.append("begin"), lambda: events.append("end")
    )
    assert shardings == ["table_wise", "pgas_table_wise"]
    one = [("train", 0), ("train", 1), "begin", ("train", 2), "end"]
    assert events == one + one, events
    dlrm = nsight.config(nsight._parse(["--scenario", "dlrm", "--scale", "0.001"]), world_size)
    assert dlrm.shape == "dlrm" and dlrm.scale == 0.001 and dlrm.zipf_alpha > 0


def test_nsight_profiles_each_sharding_between_the_ranges_start_and_stop():
    run_ranks(_nsight_steps, 2)
