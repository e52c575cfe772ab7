"""Benchmark results as JSON, a markdown table and a PNG plot."""

import json
import os
import statistics
from typing import Any, Dict, List, Sequence, Tuple

#: The measurements of each (baseline, ours) pair, in table order.
METRICS = (("forward_ms", "embedding forward"), ("dlrm_ms", "DLRM inference"), ("train_ms", "training step"))


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
    """One line per configuration and pair: times, speed-ups, agreement and floor (the
    larger of its memory and link parts, see ``floor``)."""
    lines = [
        header,
        "",
        "| scenario | configuration | pair | forward ms (theirs / ours) | DLRM inference ms | "
        "training step ms | outputs | floor ms (memory / link) | ours / floor |",
        "|---|---|---|---|---|---|---|---|---|",
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
            + f" | {agree} | {_floor(r)} | {r['ours']['forward_ms'] / r['floor_ms']:.1f}x |"
        )
    return "\n".join(lines) + "\n" + _graphed_markdown(rows)


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
    both sides place table-wise agree bit for bit (a row-wise sum's order differs)."""
    if row["identical"]:
        return "identical"
    by = row.get("max_diff_by_placement", {})
    if by and by["table_wise"] == 0:
        return f"identical table-wise, row-wise max diff {by['row_wise']:.1e}"
    return f"max diff {row['max_diff']:.1e}"


def _floor(row: Dict[str, Any]) -> str:
    """The floor and its parts, with the bandwidths they were taken at (results of
    earlier versions have the combined floor only)."""
    if "memory_ms" not in row:
        return f"{row['floor_ms']:.3f}"
    return (
        f"{row['floor_ms']:.3f} ({row['memory_ms']:.3f} at {row['copy_gbps']:.0f} GB/s / "
        f"{row['link_ms']:.3f} at {row['link_gbps']:.0f} GB/s)"
    )


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    """Speed-ups over the baseline per scenario (one panel each, a line per pair and
    measurement), if matplotlib is here."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    cols = min(4, len(scenarios))
    grid = (len(scenarios) + cols - 1) // cols
    fig, axes = plt.subplots(grid, cols, figsize=(4 * cols, 3.4 * grid), squeeze=False)
    for ax in axes.flat[len(scenarios) :]:
        ax.set_visible(False)
    colors = dict(zip((key for key, _ in METRICS), ("C0", "C1", "C2")))
    first_pairs = {tuple(r["pair"]) for r in rows if r["scenario"] == scenarios[0]}
    for ax, scenario in zip(axes.flat, scenarios):
        mine = [r for r in rows if r["scenario"] == scenario]
        shorts = list(dict.fromkeys(r["short"] for r in mine))
        # One line per pair and measurement: solid for the first pair, dashed for the next.
        for pair, style in zip(dict.fromkeys(tuple(r["pair"]) for r in mine), ("-", "--", ":")):
            points = [(shorts.index(r["short"]), r) for r in mine if tuple(r["pair"]) == pair]
            for key, name in METRICS:
                # Ours graphed (``--cuda-graph``), against the same eager TorchRec time.
                for measured, marker, mode in ((key, "o", ""), (graphed(key), "^", " graphed")):
                    shown = [(x, r) for x, r in points if measured in r["ours"]]
                    if shown:
                        ax.plot(
                            [x for x, _ in shown],
                            [r["baseline"][key] / r["ours"][measured] for _, r in shown],
                            style,
                            color=colors[key],
                            marker=marker,
                            label=f"{name}{mode}, {pair[1]}",
                        )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(range(len(shorts))))
        ax.set_xticklabels(shorts, rotation=30, fontsize=7)
        ax.set_title(scenario)
        ax.set_ylabel("speed-up over TorchRec")
        ax.set_ylim(bottom=0)
        if all(s.isdigit() for s in shorts):  # a batch sweep (``--batch-sizes``)
            ax.set_xlabel("samples per rank")
        if ax is axes[0][0] or {tuple(r["pair"]) for r in mine} != first_pairs:
            ax.legend(fontsize=7)  # every panel whose pairs the first panel's legend does not name
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(rows: List[Dict[str, Any]], meta: Dict[str, Any], out_dir: str, show: bool = True) -> None:
    """Writes ``results.json``, ``results.md`` and ``speedup.png`` (and prints the table, if ``show``)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    rounds = f", median of {meta['rounds']} alternating rounds" if meta.get("rounds", 1) > 1 else ""
    host = meta.get("host")
    on = f" (host {host['cpu']}, {host['alloc_us']:.1f} us per small allocation)" if host else ""
    table = markdown(rows, f"{meta['hardware']}{on}; median of {meta['iters']} iterations{rounds}; `{meta['command']}`")
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    plot(rows, os.path.join(out_dir, "speedup.png"))
    if show:
        print("\n" + table)
