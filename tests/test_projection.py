"""The multi-node projection: an analytic model, so the tests hold it to what it claims
(it reproduces what it was fitted on, and it moves the right way when a link slows
or GPUs are added), and run its CLI on the committed GPU results."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from torchrec_pgas.benchmark.config import Config, dlrm_config, table_specs
from torchrec_pgas.benchmark.projection import (
    LABEL,
    NODES,
    Fit,
    Links,
    check,
    config_of,
    fit,
    fit_results,
    forward_ms,
    link_ms,
    load,
    lookup_bytes,
    main,
    not_modelled,
    peer_bytes,
    scaled,
    summarize,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R1 = os.path.join(ROOT, "examples", "benchmark_results", "gpu_2xh200_r1.json")
#: How closely the model must give back the measured points it was fitted on.
FIT_TOLERANCE = 0.01


def _results():
    with open(R1) as f:
        return json.load(f)


def _fits():
    links = Links()
    return links, fit_results(_results(), links)


def _one_gpu_row():
    """A 1-GPU row in the results' format (what a launch of its own would write)."""
    row = dict(_results()["rows"][0], scenario="weak", label="1 rank")
    row["config"] = dict(row["config"], ranks=1, tables=4)
    row["ours"] = dict(row["ours"], forward_ms=0.984)
    return row


def test_the_fit_recovers_a_known_fixed_time_and_reproduces_its_points():
    links = Links(intra_gbps=300.0)
    points = [Config(tables=t, batch_size=b, ranks=r) for t, b, r in ((4, 8192, 1), (8, 8192, 2), (8, 4096, 2))]
    for overlapped in (True, False):
        truth = Fit(fixed_ms=0.37, lookup_gbps=3000.0, overlapped=overlapped, exchange_ms=0.21)
        measured = [(cfg, forward_ms(cfg, truth, links)) for cfg in points]
        got = fit(measured, 3000.0, overlapped=overlapped, links=links)
        assert math.isclose(got.fixed_ms, 0.37, rel_tol=1e-9) and math.isclose(got.exchange_ms, 0.21, rel_tol=1e-9)
        assert all(math.isclose(forward_ms(cfg, got, links), ms, rel_tol=1e-9) for cfg, ms in measured)
        # Without a 1-GPU point the exchange cannot be told from the rest: it goes into fixed.
        got = fit(measured[1:], 3000.0, overlapped=overlapped, links=links)
        assert math.isclose(got.fixed_ms, 0.58, rel_tol=1e-9) and got.exchange_ms == 0.0


def test_the_model_reproduces_the_measured_gpu_rows_it_is_fitted_on():
    links, pairs = _fits()
    rows = check(_results(), pairs, links)
    assert len(rows) == 4 and all(r["fitted"] for r in rows)  # 2 pairs x (TorchRec, ours)
    assert all(abs(r["rel_error"]) < FIT_TOLERANCE for r in rows), rows


def test_check_compares_rows_it_was_not_fitted_on():
    results, one_gpu = _results(), _one_gpu_row()
    results = dict(results, rows=results["rows"] + [one_gpu])
    links, pairs = Links(), fit_results(results, Links())
    held_out = [r for r in check(results, pairs, links) if not r["fitted"]]
    assert [(r["row"], r["side"], r["gpus"]) for r in held_out] == [
        ("weak: 1 rank", "baseline", 1),
        ("weak: 1 rank", "ours", 1),
    ]
    ours = held_out[1]
    # One GPU: nothing crosses, so the model is the fixed time plus the lookup alone.
    fitted = pairs[0].ours
    assert fitted.exchange_ms == 0.0  # fitted on 2 GPUs only
    expected = fitted.fixed_ms + lookup_bytes(Config(**one_gpu["config"])) / fitted.lookup_gbps / 1e6
    assert math.isclose(ours["model_ms"], expected, rel_tol=1e-12)
    assert math.isclose(ours["rel_error"], (expected - 0.984) / 0.984, rel_tol=1e-12)


def test_link_time_splits_peers_between_nvlink_and_the_nics():
    links = Links(intra_gbps=400.0, inter_gbps=50.0, gpus_per_node=8)
    cfg = Config(tables=8, dim=128, batch_size=1000, ids_per_bag=20, ranks=16)
    per_peer = 1000 * 8 * (20 * 8 + 128 * 4) / 16
    assert peer_bytes(cfg) == per_peer
    # 7 peers on the node over NVLink, 8 on the other node over the NICs, both at once.
    assert math.isclose(link_ms(cfg, links), max(7 * per_peer / 400.0, 8 * per_peer / 50.0) / 1e6)
    assert math.isclose(link_ms(dataclasses.replace(cfg, ranks=8), links), 7 * (per_peer * 2) / 400.0 / 1e6)
    assert link_ms(dataclasses.replace(cfg, ranks=1), links) == 0.0


def test_weak_scaling_time_never_falls_as_nodes_are_added():
    links, pairs = _fits()
    for pair in pairs:
        for model in (pair.theirs, pair.ours):
            times = [forward_ms(scaled(pair.base, "weak", n * 8), model, links) for n in NODES]
            assert all(a <= b for a, b in zip(times, times[1:])), (pair.names, times)
            assert times[-1] > times[0]  # crossing nodes costs something


def test_slower_inter_node_links_make_every_multi_node_forward_slower():
    links, pairs = _fits()
    slow = dataclasses.replace(links, inter_gbps=links.inter_gbps / 4)
    for pair in pairs:
        for model in (pair.theirs, pair.ours):
            for mode in ("weak", "strong"):
                for n in NODES:
                    cfg = scaled(pair.base, mode, n * 8)
                    fast_ms, slow_ms = forward_ms(cfg, model, links), forward_ms(cfg, model, slow)
                    assert slow_ms > fast_ms if n > 1 else slow_ms == fast_ms, (pair.names, mode, n)


def test_strong_scaling_keeps_the_global_batch_and_shrinks_each_gpus_work():
    base = Config(ranks=2, batch_size=8192)
    cfgs = [scaled(base, "strong", n * 8) for n in NODES]
    assert all(c.batch_size * c.ranks == 2 * 8192 for c in cfgs)
    work = [lookup_bytes(c) for c in cfgs]
    assert all(a > b for a, b in zip(work, work[1:]))
    assert all(scaled(base, "weak", n * 8).batch_size == 8192 for n in NODES)


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="at least one measured"):
        fit([], 1000.0, overlapped=True, links=Links())
    with pytest.raises(ValueError, match="lookup_gbps"):
        fit([(Config(), 1.0)], 0.0, overlapped=True, links=Links())
    with pytest.raises(ValueError, match="scaling mode 'both'"):
        scaled(Config(), "both", 8)
    with pytest.raises(ValueError, match="no rows with a 'config'"):
        fit_results({"rows": [{"scenario": "weak"}]}, Links())
    with pytest.raises(SystemExit):
        main(["--check", R1, "--tolerance", "0"])


def test_cli_projects_the_committed_gpu_results_and_labels_them(tmp_path):
    out, one_gpu = str(tmp_path / "proj"), str(tmp_path / "one_gpu.json")
    with open(one_gpu, "w") as f:
        json.dump({"meta": {}, "rows": [_one_gpu_row()]}, f)
    cmd = [sys.executable, "-m", "torchrec_pgas.benchmark.projection", "--results", R1, one_gpu, "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    table = open(os.path.join(out, "projection.md")).read()
    headings = [line for line in table.splitlines() if line.startswith("#")]
    assert len(headings) == 4 and all(LABEL in h for h in headings)
    rows = [line for line in table.splitlines() if line.startswith("| pgas_")]
    assert len(rows) == 2 * 2 * len(NODES)  # 2 pairs x (weak, strong) x node counts
    assert "| 16 | 128 |" in table
    checked = [line for line in table.splitlines() if line.endswith(("| fitted on |", "| held out |"))]
    assert len(checked) == 6 and sum(line.endswith("| held out |") for line in checked) == 2
    assert os.path.getsize(os.path.join(out, "projection.png")) > 10_000
    with open(os.path.join(out, "projection.json")) as f:
        assert json.load(f)["label"] == LABEL


def test_the_dlrm_scenario_is_modelled_by_its_own_pooling_factors_and_fitted_as_its_own_pair():
    cfg = dlrm_config(Config(dim=128, batch_size=4096, ranks=2), 0.25)
    ids = sum(s.ids_per_bag for s in table_specs(cfg))
    assert ids == 214  # MLPerf DLRM v2's multi-hot pooling factors over 26 tables
    assert lookup_bytes(cfg) == 4096 * (214 * (512 + 8) + 26 * 512)
    assert peer_bytes(cfg) == 4096 * (214 * 8 + 26 * 512) / 2
    # A results row of the scenario (as the benchmark writes it) fits and projects as
    # a pair of its own, next to R1's pairs.
    row = dict(_results()["rows"][0], scenario="dlrm", label=cfg.label())
    row.update(config=dataclasses.asdict(cfg), pair=["table_wise+row_wise", "pgas_table_wise+pgas_row_wise"])
    results = dict(_results(), rows=_results()["rows"] + [row])
    links = Links()
    pairs = fit_results(results, links)
    mixed = next(p for p in pairs if p.names == ("table_wise+row_wise", "pgas_table_wise+pgas_row_wise"))
    assert mixed.base == cfg and len(pairs) == 3
    checked = [c for c in check(results, pairs, links) if c["row"].startswith("dlrm")]
    assert len(checked) == 2 and all(abs(c["rel_error"]) < FIT_TOLERANCE for c in checked)
    assert scaled(cfg, "weak", 16).shape == "dlrm"  # projected with its own tables


# ------------------------------------------------------------------ the check mode

#: The model the fake results below are made from: every number known.
TRUTH_LINKS = Links(intra_gbps=300.0)
TRUTH = {
    "baseline": Fit(fixed_ms=0.61, lookup_gbps=3000.0, overlapped=False, exchange_ms=0.83),
    "ours": Fit(fixed_ms=0.29, lookup_gbps=3000.0, overlapped=True, exchange_ms=0.17),
}
PAIRS = (["table_wise", "pgas_table_wise"], ["row_wise", "pgas_row_wise"])


def _fake_row(cfg, scenario, pair, copy_gbps=3000.0, with_config=True, **extra):
    """A results row whose forward times are the truth model's, in the benchmark's format
    (``with_config=False``: a row copied from a printed table, the label only)."""
    row = {"scenario": scenario, "label": cfg.label(), "pair": list(pair), "copy_gbps": copy_gbps, **extra}
    if with_config:
        row["config"] = dataclasses.asdict(cfg)
    else:
        del row["copy_gbps"]
    for side, model in TRUTH.items():
        row[side] = {"forward_ms": forward_ms(cfg, model, TRUTH_LINKS)}
    return row


def _fake_files(tmp_path, held_copy_gbps=3000.0):
    """A fit file (R1 on 1 and 2 GPUs at two batch sizes) and a file of rows held out
    (other dims, ids per bag, batches, tables; some from a printed table), fresh sizes."""
    fit_rows, held_rows = [], []
    for pair in PAIRS:
        for ranks, batch in ((1, 4096), (1, 9000), (2, 8192), (2, 3000)):
            fit_rows.append(_fake_row(Config(ranks=ranks, batch_size=batch), "r1", pair))
        for i, cfg in enumerate(
            (
                Config(dim=32, batch_size=700),
                Config(dim=256, ids_per_bag=3, batch_size=65536),
                Config(tables=5, rows=777, ids_per_bag=57, batch_size=12345, ranks=1),
                Config(tables=3, batch_size=40000, zipf_alpha=1.05),
            )
        ):
            held_rows.append(_fake_row(cfg, "sweep", pair, copy_gbps=held_copy_gbps, with_config=i % 2 == 0))
    paths = str(tmp_path / "fit.json"), str(tmp_path / "held.json")
    for path, rows in zip(paths, (fit_rows, held_rows)):
        with open(path, "w") as f:
            json.dump({"meta": {}, "rows": rows}, f)
    return paths


def test_printed_labels_give_back_their_config_and_others_are_left_out_by_name():
    small = Config(tables=3, rows=77, dim=32, batch_size=5, ids_per_bag=1, zipf_alpha=1.05, ranks=1)
    for cfg in (Config(), small, dataclasses.replace(small, optimizer="rowwise_adagrad")):
        assert config_of({"label": cfg.label()}) == cfg
    assert config_of({"label": "1 ranks, DLRM-shaped 26 tables"}) is None
    results = {"rows": [_fake_row(Config(), "r1", PAIRS[0]), {"scenario": "x", "label": "?", "pair": PAIRS[1]}]}
    results["rows"].append(_fake_row(Config(), "r1", ["a", "b"], with_config=False))
    pairs = fit_results({"rows": results["rows"][:1]}, TRUTH_LINKS)
    left_out = not_modelled(results, pairs)
    assert len(left_out) == 2 and "no configuration" in left_out[0] and "has no fit" in left_out[1], left_out
    assert len(check(results, pairs, TRUTH_LINKS)) == 2  # the modelled row, both sides


def test_check_gives_back_a_known_model_on_rows_it_was_not_fitted_on(tmp_path):
    fit_path, held_path = _fake_files(tmp_path)
    pairs = fit_results(load([fit_path]), TRUTH_LINKS)
    for pair in pairs:
        for side, got in (("baseline", pair.theirs), ("ours", pair.ours)):
            assert math.isclose(got.fixed_ms, TRUTH[side].fixed_ms, rel_tol=1e-9)
            assert math.isclose(got.exchange_ms, TRUTH[side].exchange_ms, rel_tol=1e-9)
    checked = check(load([fit_path, held_path]), pairs, TRUTH_LINKS)
    assert len(checked) == 2 * 2 * 8 and sum(not c["fitted"] for c in checked) == 16
    assert {c["source"] for c in checked if not c["fitted"]} == {"held.json"}
    assert all(math.isclose(c["ratio"], 1.0, rel_tol=1e-9) for c in checked), checked
    summary = summarize(checked, tolerance=0.01)
    assert {(s["side"], s["gpus"], s["rows"]) for s in summary} == {
        (side, gpus, rows) for side in ("baseline", "ours") for gpus in (1, 2) for rows in ("held out", "all")
    }
    assert all(s["outside"] == 0 and math.isclose(s["median_ratio"], 1.0, rel_tol=1e-9) for s in summary)


def test_put_path_rows_are_checked_apart_and_never_fitted_on(tmp_path):
    """Rows of a run on the put path (``options.remote_path``) are left out of the fit
    (the model's link is the peer stores), checked against the same model, and
    summarized apart; a file of put-path rows alone gives nothing to fit on."""
    fit_path, _ = _fake_files(tmp_path)
    rows = json.load(open(fit_path))["rows"]
    # The put path of the same configurations, 30% slower on our side (TorchRec's as it was).
    put = [dict(r, options={"remote_path": "put"}) for r in rows]
    for r in put:
        r["ours"] = {"forward_ms": 1.3 * r["ours"]["forward_ms"]}
    results = {"rows": [dict(r, source="fit.json") for r in rows] + [dict(r, source="put.json") for r in put]}
    pairs = fit_results(results, TRUTH_LINKS)
    alone = fit_results({"rows": rows}, TRUTH_LINKS)
    assert [(p.theirs, p.ours) for p in pairs] == [(p.theirs, p.ours) for p in alone]  # the put rows moved nothing
    checked = check(results, pairs, TRUTH_LINKS)
    on_put = [c for c in checked if c["remote_path"] == "put"]
    assert len(on_put) == len(put) * 2 and not any(c["fitted"] for c in on_put)
    assert all(math.isclose(c["ratio"], 1 / 1.3 if c["side"] == "ours" else 1.0) for c in on_put)
    summary = {(s["side"], s["gpus"], s["remote_path"], s["rows"]): s for s in summarize(checked, tolerance=0.25)}
    assert math.isclose(summary[("ours", 2, "put", "held out")]["median_ratio"], 1 / 1.3)
    assert summary[("ours", 2, "put", "held out")]["outside"] == 2 * 2  # two 2-GPU rows per pair
    assert summary[("ours", 2, "auto", "all")]["outside"] == 0 and ("ours", 2, "auto", "held out") not in summary
    with pytest.raises(ValueError, match="every row ran on the put path"):
        fit_results({"rows": put}, TRUTH_LINKS)


def test_check_uses_a_rows_own_link_bandwidth():
    cfg = Config(batch_size=30000, dim=256)
    row = _fake_row(cfg, "r1", PAIRS[0])
    pairs = fit_results({"rows": [row]}, TRUTH_LINKS)
    slow = dict(row, label=row["label"] + " ", link_gbps=30.0)
    ours = [c for c in check({"rows": [row, slow]}, pairs, TRUTH_LINKS) if c["side"] == "ours"]
    assert math.isclose(ours[0]["model_ms"], forward_ms(cfg, pairs[0].ours, TRUTH_LINKS), rel_tol=1e-12)
    expected = forward_ms(cfg, pairs[0].ours, dataclasses.replace(TRUTH_LINKS, intra_gbps=30.0))
    assert math.isclose(ours[1]["model_ms"], expected, rel_tol=1e-12) and expected > 2 * ours[0]["model_ms"]


@pytest.mark.parametrize("wrong", ["nvlink 10x slower", "rows' copy bandwidth halved"])
def test_a_wrong_model_fails_the_check_visibly(tmp_path, wrong):
    fit_path, held_path = _fake_files(tmp_path, held_copy_gbps=1500.0 if "copy" in wrong else 3000.0)
    intra = TRUTH_LINKS.intra_gbps / (10 if "nvlink" in wrong else 1)
    md = str(tmp_path / "check.md")
    argv = ["--results", fit_path, "--check", held_path, fit_path, "--check-md", md, "--intra-gbps", str(intra)]
    main(argv)  # without --strict it reports, and exits 0
    rows = [line for line in open(md).read().splitlines() if line.endswith("| held out |")]
    assert len(rows) == 16 and sum("**off**" in line for line in rows) >= 2, rows
    with pytest.raises(SystemExit, match=r"checked rows off by more than 25%"):
        main(argv + ["--strict"])
    # The right model on the same rows passes --strict, even at 0.1%.
    _fake_files(tmp_path)
    main(argv[:-1] + [str(TRUTH_LINKS.intra_gbps), "--strict", "--tolerance", "0.001"])
    rows = [line for line in open(md).read().splitlines() if line.endswith(("| held out |", "| fitted on |"))]
    assert len(rows) == 32 and not any("**off**" in line for line in rows)


def test_the_committed_check_is_what_its_command_writes_now(tmp_path):
    """examples/benchmark_results/projection_check.md is generated: when the model or
    the results change, regenerate it with the command on its third line."""
    with open(os.path.join(ROOT, "examples", "benchmark_results", "projection_check.md")) as f:
        committed = f.read()
    command = committed.splitlines()[2].split("`")[1].split()
    assert command[:3] == ["python", "-m", "torchrec_pgas.benchmark.projection"], command
    out, cwd = str(tmp_path / "check.md"), os.getcwd()
    os.chdir(ROOT)
    try:
        main(command[3:] + ["--check-md", out])
    finally:
        os.chdir(cwd)
    assert open(out).read() == committed
