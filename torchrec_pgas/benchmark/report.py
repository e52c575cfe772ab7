"""Benchmark results as JSON, a markdown table and a PNG plot.

A results file of any version of the benchmark renders again (older ones lack the
floor's parts, or the graphed times; their cells say n/a):

    python -m torchrec_pgas.benchmark.report bench/results.json [--out DIR]

Several results files (runs of two trees, say) are compared: for every configuration
and pair they share, TorchRec's eager time over ours in each run, eager and graphed, as
a table (``compare.md``) and a plot of the speed-ups against the configurations, a
panel per scenario and pair, a line style per run (``compare.png``):

    python -m torchrec_pgas.benchmark.report before/results.json after/results.json \
        --labels before,after --out DIR
"""

import argparse
import json
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torchrec_pgas.benchmark.floor import LINK_BANDWIDTH, MEMORY_BANDWIDTH

#: The measurements of each (baseline, ours) pair, in table order.
METRICS = (("forward_ms", "embedding forward"), ("dlrm_ms", "DLRM inference"), ("train_ms", "training step"))
#: A measurement's color in the plots.
_COLORS = dict(zip((key for key, _ in METRICS), ("C0", "C1", "C2")))


def graphed(key: str) -> str:
    """The key of a measurement's time captured in a CUDA graph and replayed
    (``--cuda-graph``; ours only): ``forward_ms`` -> ``forward_graphed_ms``."""
    return key.replace("_ms", "_graphed_ms")


def eager(key: str) -> str:
    """The eager measurement a (possibly graphed) key is compared with: TorchRec's
    side runs eagerly only, so every speed-up divides its eager time."""
    return key.replace("_graphed", "")


def summarize(rounds: Sequence[Tuple[Dict[str, float], Dict[str, float]]]) -> Dict[str, Any]:
    """The (TorchRec, ours) times of every round: per side, each measurement's median
    over the rounds; and per round, TorchRec's eager time over each of ours, eager
    and graphed (a ratio is taken within a round, where both sides ran on the same
    host state)."""
    base = {key: statistics.median(b[key] for b, _ in rounds) for key in rounds[0][0]}
    ours = {key: statistics.median(o[key] for _, o in rounds) for key in rounds[0][1]}
    per_round = {key: [b[eager(key)] / o[key] for b, o in rounds] for key in ours}
    return {"baseline": base, "ours": ours, "speedup_per_round": per_round}


def markdown(rows: List[Dict[str, Any]], header: str) -> str:
    """One line per configuration and pair: times, speed-ups, agreement, and the floor
    with its memory and link parts (``floor``), each at the bandwidth it was taken at
    (said under the table)."""
    lines = [
        header,
        "",
        "| scenario | configuration | pair | forward ms (theirs / ours) | DLRM inference ms | "
        "training step ms | outputs | floor ms | memory part ms | link part ms | ours / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for key, _ in METRICS:
            base, ours = r["baseline"][key], r["ours"][key]
            cells.append(f"{base:.3f} / {ours:.3f} (**{base / ours:.2f}x**{_spread(r, key)})")
        agree = _agreement(r)
        lines.append(
            f"| {r['scenario']} | {r['label']} | {r['pair'][1]} vs {r['pair'][0]} | "
            + " | ".join(cells)
            + f" | {agree} | {_floor(r)} | {_memory_part(r)} | {_link_part(r)} | {_over_floor(r)} |"
        )
    lines += ["", FLOOR_LEGEND]
    return "\n".join(lines) + "\n" + _graphed_markdown(rows)


#: What the floor's columns are (under the table).
FLOOR_LEGEND = (
    f"Floor: the larger of its two parts (the lookup overlaps its puts), for the busiest rank. "
    f"Memory part: rows and ids read, pooled rows written, over the {MEMORY_BANDWIDTH}. "
    f"Link part: ids and pooled rows sent to other ranks, over the {LINK_BANDWIDTH}."
)


def _spread(row: Dict[str, Any], key: str) -> str:
    """The rounds' range of the speed-up of ``key``, where there were rounds."""
    spread = row.get("speedup_per_round", {}).get(key, [])
    return f", rounds {min(spread):.2f}-{max(spread):.2f}x" if len(spread) > 1 else ""


def _graphed_markdown(rows: List[Dict[str, Any]]) -> str:
    """The rows measured with ``--cuda-graph``: per measurement, TorchRec's eager time,
    ours eager and ours graphed, with TorchRec's eager time over ours graphed (what
    a user of ours with CUDA graphs gains over TorchRec as it runs) and ours eager
    over ours graphed (what the graph alone gains); empty without such rows."""
    rows = [r for r in rows if graphed("forward_ms") in r["ours"]]
    if not rows:
        return ""
    reasons: Dict[str, List[str]] = {}
    for r in rows:
        reasons.setdefault(r["baseline_graphed"], []).append(r["pair"][0])
    theirs = "; ".join(f"{', '.join(dict.fromkeys(names))}: {reason}" for reason, names in reasons.items())
    lines = [
        "",
        "CUDA graphs (`--cuda-graph`): ours captured once per model and replayed, inputs copied in. "
        f"TorchRec's sharding graphed: {theirs}. Each cell: TorchRec eager / ours eager / ours graphed ms "
        "(**TorchRec eager / ours graphed**, ours eager / ours graphed).",
        "",
        "| scenario | configuration | pair | forward ms | DLRM inference ms | training step ms | graphed outputs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for key, _ in METRICS:
            base, ours = r["baseline"][key], r["ours"][key]
            if graphed(key) not in r["ours"]:
                cells.append(f"{base:.3f} / {ours:.3f} / n/a")
                continue
            replayed = r["ours"][graphed(key)]
            cells.append(
                f"{base:.3f} / {ours:.3f} / {replayed:.3f} "
                f"(**{base / replayed:.2f}x**{_spread(r, graphed(key))}, graphs {ours / replayed:.2f}x)"
            )
        diff = r["graphed_max_diff"]
        agree = "identical to eager" if diff == 0 else f"max diff {diff:.1e} from eager"
        lines.append(
            f"| {r['scenario']} | {r['label']} | {r['pair'][1]} vs {r['pair'][0]} | "
            + " | ".join(cells)
            + f" | {agree} |"
        )
    return "\n".join(lines) + "\n"


def _agreement(row: Dict[str, Any]) -> str:
    """Identical, or the largest difference, split by placement where the tables that
    both sides place table-wise agree bit for bit (a row-wise sum's order differs);
    n/a where the results kept no comparison."""
    if row.get("identical"):
        return "identical"
    if "max_diff" not in row:
        return "n/a"
    by = row.get("max_diff_by_placement", {})
    if by and by["table_wise"] == 0:
        return f"identical table-wise, row-wise max diff {by['row_wise']:.1e}"
    return f"max diff {row['max_diff']:.1e}"


def _floor(row: Dict[str, Any]) -> str:
    return "n/a" if row.get("floor_ms") is None else f"{row['floor_ms']:.3f}"


def _over_floor(row: Dict[str, Any]) -> str:
    return "n/a" if row.get("floor_ms") is None else f"{row['ours']['forward_ms'] / row['floor_ms']:.1f}x"


def _memory_part(row: Dict[str, Any]) -> str:
    """The floor's memory part and the copy bandwidth it was taken at (n/a in results
    of versions that recorded the combined floor only)."""
    if "memory_ms" not in row:
        return "n/a"
    return f"{row['memory_ms']:.3f} at {row['copy_gbps']:.0f} GB/s"


def _link_part(row: Dict[str, Any]) -> str:
    """The floor's link part and the device-initiated put bandwidth it was taken at;
    older results measured a host-issued put (``put_gbps``) and kept no link part."""
    if "link_ms" not in row:
        put = row.get("put_gbps")
        return f"n/a (run measured a host-issued put, {put:.0f} GB/s)" if put else "n/a"
    if not row["link_gbps"] and not row["link_ms"]:
        return "0 (one rank)"
    return f"{row['link_ms']:.3f} at {row['link_gbps']:.0f} GB/s"


def _panels(n: int, cols: int, width: float, height: float):
    """A figure of ``n`` panels, ``cols`` a row (the rest hidden), as ``(fig, axes)``;
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cols = min(cols, n)
    grid = (n + cols - 1) // cols
    fig, axes = plt.subplots(grid, cols, figsize=(width * cols, height * grid), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes


def _speedup_lines(ax, points: Sequence[Tuple[int, Dict[str, Any]]], style: str, suffix: str) -> None:
    """Per measurement (a color each), the speed-ups of the rows at ``points`` (x, row):
    eager (circles) and ours graphed (triangles), against the same eager TorchRec time."""
    for key, name in METRICS:
        for measured, marker, mode in ((key, "o", ""), (graphed(key), "^", " graphed")):
            shown = [(x, v) for x, v in ((x, _speedup(r, measured)) for x, r in points) if v is not None]
            if shown:
                ax.plot(
                    [x for x, _ in shown],
                    [v for _, v in shown],
                    style,
                    color=_COLORS[key],
                    marker=marker,
                    label=f"{name}{mode}, {suffix}",
                )


def _speedup_axes(ax, shorts: Sequence[str]) -> None:
    """A speed-up panel's axes: the configurations on x, the line of equal speed."""
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(range(len(shorts))))
    ax.set_xticklabels(shorts, rotation=30, fontsize=7)
    ax.set_ylabel("speed-up over TorchRec")
    if all(s.isdigit() for s in shorts):  # a batch sweep (``--batch-sizes``)
        ax.set_xlabel("samples per rank")


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    """Speed-ups over the baseline per scenario (one panel each, a line per pair and
    measurement), if matplotlib is here."""
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    drawn = _panels(len(scenarios), 4, 4, 3.4)
    if drawn is None:
        return
    fig, axes = drawn
    first_pairs = {tuple(r["pair"]) for r in rows if r["scenario"] == scenarios[0]}
    for ax, scenario in zip(axes.flat, scenarios):
        mine = [r for r in rows if r["scenario"] == scenario]
        shorts = list(dict.fromkeys(r["short"] for r in mine))
        # One line per pair and measurement: solid for the first pair, dashed for the next.
        for pair, style in zip(dict.fromkeys(tuple(r["pair"]) for r in mine), ("-", "--", ":")):
            points = [(shorts.index(r["short"]), r) for r in mine if tuple(r["pair"]) == pair]
            _speedup_lines(ax, points, style, pair[1])
        _speedup_axes(ax, shorts)
        ax.set_title(scenario)
        ax.set_ylim(bottom=0)
        if ax is axes[0][0] or {tuple(r["pair"]) for r in mine} != first_pairs:
            ax.legend(fontsize=7)  # every panel whose pairs the first panel's legend does not name
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def header(meta: Dict[str, Any]) -> str:
    """The table's first line: hardware, host, iterations, rounds and command, as far
    as ``meta`` has them (older results lack some)."""
    rounds = f", median of {meta['rounds']} alternating rounds" if meta.get("rounds", 1) > 1 else ""
    host = meta.get("host")
    on = f" (host {host['cpu']}, {host['alloc_us']:.1f} us per small allocation)" if host else ""
    iters = f"; median of {meta['iters']} iterations" if "iters" in meta else ""
    command = f"; `{meta['command']}`" if "command" in meta else ""
    note = f"; {meta['note']}" if "note" in meta else ""
    return f"{meta.get('hardware', 'unknown hardware')}{on}{iters}{rounds}{command}{note}"


def write(rows: List[Dict[str, Any]], meta: Dict[str, Any], out_dir: str, show: bool = True) -> None:
    """Writes ``results.json``, ``results.md`` and ``speedup.png`` (and prints the table, if ``show``)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    table = markdown(rows, header(meta))
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    plot(rows, os.path.join(out_dir, "speedup.png"))
    if show:
        print("\n" + table)


def load(path: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The rows and meta of a ``results.json`` of any version (see module doc)."""
    with open(path) as f:
        results = json.load(f)
    return results.get("rows", []), results.get("meta", {})


def _speedup(row: Dict[str, Any], key: str) -> Optional[float]:
    """TorchRec's eager time over ours for ``key`` (eager or graphed), if measured."""
    if key not in row.get("ours", {}) or eager(key) not in row.get("baseline", {}):
        return None
    return row["baseline"][eager(key)] / row["ours"][key]


def _shared(runs: Sequence[List[Dict[str, Any]]]) -> List[Tuple[str, str, Tuple[str, ...]]]:
    """The (scenario, configuration, pair) of the rows every run has, in the first run's order."""
    keys = [[(r["scenario"], r["short"], tuple(r["pair"])) for r in rows] for rows in runs]
    return [k for k in keys[0] if all(k in other for other in keys[1:])]


def compare_markdown(runs: Sequence[List[Dict[str, Any]]], labels: Sequence[str]) -> str:
    """One line per configuration and pair that every run has: per measurement, the
    speed-up over TorchRec in each run (``labels`` order), eager then graphed."""
    index = [{(r["scenario"], r["short"], tuple(r["pair"])): r for r in rows} for rows in runs]
    keys = [k for key, _ in METRICS for k in (key, graphed(key))]
    shown = [k for k in keys if any(_speedup(r, k) is not None for rows in runs for r in rows)]
    names = dict(METRICS)
    head = [f"{names[eager(k)]}{' graphed' if k != eager(k) else ''}" for k in shown]
    lines = [
        f"TorchRec's eager time over ours, per run: {' / '.join(labels)}",
        "",
        "| scenario | configuration | pair | " + " | ".join(head) + " |",
        "|---|---|---|" + "---|" * len(shown),
    ]
    for key in _shared(runs):
        cells = []
        for k in shown:
            values = [_speedup(run[key], k) for run in index]
            cells.append(" / ".join("n/a" if v is None else f"{v:.2f}x" for v in values))
        lines.append(f"| {key[0]} | {key[1]} | {key[2][1]} vs {key[2][0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare_plot(runs: Sequence[List[Dict[str, Any]]], labels: Sequence[str], path: str) -> None:
    """Speed-ups over TorchRec per scenario and pair (one panel each): a color per
    measurement, a line style per run, eager (circles) and graphed (triangles)."""
    shared = _shared(runs)
    panels = list(dict.fromkeys((scenario, pair) for scenario, _, pair in shared))
    drawn = _panels(len(panels), 3, 4.5, 3.6)
    if drawn is None:
        return
    fig, axes = drawn
    index = [{(r["scenario"], r["short"], tuple(r["pair"])): r for r in rows} for rows in runs]
    for ax, (scenario, pair) in zip(axes.flat, panels):
        shorts = [short for s, short, p in shared if (s, p) == (scenario, pair)]
        for run, label, style in zip(index, labels, ("-", "--", ":", "-.")):
            _speedup_lines(ax, [(x, run[(scenario, short, pair)]) for x, short in enumerate(shorts)], style, label)
        _speedup_axes(ax, shorts)
        ax.set_title(f"{scenario}: {pair[1]} vs {pair[0]}", fontsize=9)
        # Log-scaled: the large batches' ratios near 1 stay apart next to the small ones'.
        ax.set_yscale("log", base=2)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description="Renders a benchmark's results.json again, or compares several.")
    p.add_argument("results", nargs="+", help="results.json of `python -m torchrec_pgas.benchmark` (several: compared)")
    p.add_argument("--labels", default=None, help="comma-separated names of the compared runs (default: their folders)")
    p.add_argument("--out", default=None, help="write the files here (else print the table)")
    args = p.parse_args(argv)
    loaded = [load(path) for path in args.results]
    for path, (rows, _) in zip(args.results, loaded):
        if not rows:
            raise SystemExit(f"{path}: no result rows to render")
    if len(loaded) == 1:
        rows, meta = loaded[0]
        if args.out:
            write(rows, meta, args.out)
        else:
            print(markdown(rows, header(meta)))
        return
    labels = (
        args.labels.split(",")
        if args.labels
        else [os.path.basename(os.path.dirname(os.path.abspath(r))) for r in args.results]
    )
    if len(labels) != len(loaded):
        raise SystemExit(f"--labels names {len(labels)} runs, {len(loaded)} results files given")
    runs = [rows for rows, _ in loaded]
    if not _shared(runs):
        raise SystemExit("the results files share no configuration and pair to compare")
    table = compare_markdown(runs, labels)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compare.md"), "w") as f:
            f.write(table)
        compare_plot(runs, labels, os.path.join(args.out, "compare.png"))
    print(table)


if __name__ == "__main__":
    main()
