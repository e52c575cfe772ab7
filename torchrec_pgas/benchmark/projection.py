"""A projection (model, not measured) of the embedding forward on 1 to 16 nodes of 8
GPUs, ours and TorchRec's (NCCL all-to-all), from the benchmark's single-node results.

    python -m torchrec_pgas.benchmark.projection --results results.json --out projection

Nothing here is measured beyond one node: the numbers are an analytic model fitted on
the results file, and every table and plot it writes says so. The model, per GPU and
per forward, for a configuration of ``N`` GPUs (``Config``: ``T`` tables of dim ``D``,
``B`` samples per GPU, ``L`` ids per bag):

* lookup: the owner reads ``B * T * L`` rows (and their ids) and writes ``B * T``
  pooled rows, the tables spread evenly over the GPUs (a balanced placement: row-wise
  for tables larger than a GPU's share), at the lookup bandwidth (the device's measured
  copy bandwidth: the rate a memory-bound lookup reaches at best);
* link: each peer gets ``B * T * (8 L + 4 D) / N`` bytes (its ids out, its pooled rows
  back); the ``g - 1`` peers of the same node over NVLink, the others over the node's
  NICs, both at once, so the link takes the slower of the two (bandwidths per GPU and
  direction, stated in ``Links``);
* fixed: a per-step time that does not depend on the data (launches, host work),
  plus, on more than one GPU, the per-step cost of having an exchange at all
  (collectives' set-up, synchronization): both fitted per implementation on the
  measured rows (the second only when rows on 1 GPU and on more are both fitted on;
  otherwise it stays in the first), plus a stated cost per peer
  (``Links.pgas_peer_ms``, ``Links.nccl_peer_ms``).

Ours overlaps the lookup and the link (the lookup kernel stores each pooled row straight
into the requester's output): ``fixed + exchange + peers * pgas_peer_ms + max(lookup, link)``.
TorchRec runs an all-to-all of the ids, the lookup, then an all-to-all of the pooled
rows, one after the other: ``fixed + exchange + 2 * peers * nccl_peer_ms + lookup + link``
(NCCL credited with the same link bandwidth as our puts).

Weak scaling keeps the samples per GPU (and the tables) fixed as GPUs are added: the
lookup per GPU stays, the share of bytes crossing nodes grows. Strong scaling keeps the
global batch: the lookup per GPU shrinks as ``1 / N``.

``check`` compares the model with every configuration in the results files, the ones
it was fitted on and the ones it was not (1 and 2 GPUs: what one node here can measure;
on GPUs a launch measures on all its GPUs only, so the 1-GPU rows come from a launch of
their own, its results file given next to the other). Its own mode reads results files
only (no GPU), fits on ``--results`` and checks every row of the ``--check`` files it
can model, with a summary of model / measured per side and GPU count:

    python -m torchrec_pgas.benchmark.projection --results fit.json [one_gpu.json] \
        --check results/*.json --check-md check.md [--tolerance 0.25 --strict]

Rows copied from printed tables (no ``config``) are modelled from their label.

Limits, each a reason the projection is not a measurement: row-wise pairs are modelled
with table-wise traffic (no partial sums); the lookup runs at the copy bandwidth, so
all that a real lookup loses against it is counted in the fixed times, which then do
not shrink with the batch; NCCL's all-to-all is credited with the puts' bandwidth, and
neither with congestion in the network; R1's 8 tables are fewer than the GPUs of two
nodes, so a balanced placement (row-wise) is assumed. The DLRM-shaped scenario (``dlrm``:
tables of very different sizes and pooling factors) is modelled by its total ids per
sample (each table's own ``L``, ``config.table_specs``) under the same balanced
placement: its rows are fitted as their own pair (``--fit-scenarios dlrm``), but its
load imbalance (a 100-id table on one owner) is not modelled.
"""

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torchrec_pgas.benchmark.config import Config, table_specs

LABEL = "projection (model, not measured)"
NODES: Tuple[int, ...] = (1, 2, 4, 8, 16)
MODES = ("weak", "strong")
#: Device-initiated put+signal over NVLink 4 on 2 x H200 (1024 blocks, 256 MiB), used
#: when the results file has no link bandwidth measured that way.
DEFAULT_INTRA_GBPS = 347.0
_ID_BYTES = 8
_ELEM_BYTES = 4


@dataclass(frozen=True)
class Links:
    """Bandwidths per GPU and direction (GB/s) and costs per peer (ms): stated, not fitted.

    ``inter_gbps`` defaults to 8 x 400 Gb/s NICs per node of 8 GPUs (50 GB/s per GPU);
    the per-peer costs are what a peer adds to a step: a signal and its wait for ours,
    a send/receive pair of an all-to-all for NCCL."""

    intra_gbps: float = DEFAULT_INTRA_GBPS
    inter_gbps: float = 50.0
    gpus_per_node: int = 8
    pgas_peer_ms: float = 0.001
    nccl_peer_ms: float = 0.005


@dataclass(frozen=True)
class Fit:
    """One implementation's fitted per-step times (``exchange_ms`` only on more than one
    GPU), and its lookup bandwidth (GB/s)."""

    fixed_ms: float
    lookup_gbps: float
    overlapped: bool  # ours: lookup and link at once; NCCL's: one after the other
    exchange_ms: float = 0.0


def _ids_per_sample(cfg: Config) -> int:
    """Ids of one sample over all its tables."""
    return sum(s.ids_per_bag for s in table_specs(cfg))


def lookup_bytes(cfg: Config) -> float:
    """Memory traffic of one GPU's lookups (rows and ids read, pooled rows written)."""
    row = cfg.dim * _ELEM_BYTES
    return cfg.batch_size * (_ids_per_sample(cfg) * (row + _ID_BYTES) + cfg.tables * row)


def peer_bytes(cfg: Config) -> float:
    """Bytes one GPU sends to each peer (its ids there, the pooled rows it owes)."""
    return cfg.batch_size * (_ids_per_sample(cfg) * _ID_BYTES + cfg.tables * cfg.dim * _ELEM_BYTES) / cfg.ranks


def link_ms(cfg: Config, links: Links) -> float:
    """NVLink and NICs carry their peers' bytes at once: the slower of the two."""
    local = min(cfg.ranks, links.gpus_per_node) - 1
    remote = cfg.ranks - 1 - local
    nbytes = peer_bytes(cfg)
    return max(local * nbytes / links.intra_gbps, remote * nbytes / links.inter_gbps) / 1e6


def _variable_ms(cfg: Config, fit: Fit, links: Links) -> float:
    """The model's time of ``cfg`` without the fitted fixed part."""
    lookup = lookup_bytes(cfg) / fit.lookup_gbps / 1e6
    peers = cfg.ranks - 1
    exchange = fit.exchange_ms if peers else 0.0
    if fit.overlapped:
        return exchange + peers * links.pgas_peer_ms + max(lookup, link_ms(cfg, links))
    return exchange + 2 * peers * links.nccl_peer_ms + lookup + link_ms(cfg, links)


def forward_ms(cfg: Config, fit: Fit, links: Links) -> float:
    """The model's forward time of ``cfg`` (see module doc)."""
    return fit.fixed_ms + _variable_ms(cfg, fit, links)


def fit(measured: Sequence[Tuple[Config, float]], lookup_gbps: float, overlapped: bool, links: Links) -> Fit:
    """The fixed times that best fit ``(config, forward ms)`` points (least squares: mean
    residuals), at a given lookup bandwidth: ``fixed_ms`` from the 1-GPU points and
    ``exchange_ms`` from the others where there are both, else all in ``fixed_ms``."""
    if not measured:
        raise ValueError("fit needs at least one measured (config, forward ms) point")
    if lookup_gbps <= 0:
        raise ValueError(f"lookup_gbps must be positive, got {lookup_gbps}")
    shape = Fit(0.0, lookup_gbps, overlapped)
    residuals = [(cfg.ranks > 1, ms - _variable_ms(cfg, shape, links)) for cfg, ms in measured]
    single = [r for multi, r in residuals if not multi]
    multi = [r for many, r in residuals if many]
    if not (single and multi):
        return dataclasses.replace(shape, fixed_ms=max(statistics.fmean(single or multi), 0.0))
    fixed = max(statistics.fmean(single), 0.0)
    return dataclasses.replace(shape, fixed_ms=fixed, exchange_ms=max(statistics.fmean(multi) - fixed, 0.0))


def scaled(base: Config, mode: str, gpus: int) -> Config:
    """``base`` on ``gpus`` GPUs: samples per GPU kept (weak) or the global batch kept (strong)."""
    if mode == "weak":
        return dataclasses.replace(base, ranks=gpus)
    if mode == "strong":
        return dataclasses.replace(base, ranks=gpus, batch_size=max(1, base.batch_size * base.ranks // gpus))
    raise ValueError(f"unknown scaling mode {mode!r}: expected one of {MODES}")


# ------------------------------------------------------------------ results file


@dataclass(frozen=True)
class Pair:
    """One (TorchRec, ours) sharding pair fitted on a results file."""

    names: Tuple[str, str]
    base: Config
    theirs: Fit
    ours: Fit
    fitted_on: Tuple[Tuple[str, ...], ...]  # ``row_key`` of the rows fitted on


#: The label the benchmark prints for a uniform configuration (``Config.label``): rows
#: copied from printed tables carry it and no ``config``.
_LABEL = re.compile(
    r"(?P<ranks>\d+) ranks, (?P<tables>\d+) x (?P<rows>\d+) x (?P<dim>\d+), (?P<batch_size>\d+)/rank, "
    r"(?P<ids_per_bag>\d+) ids/bag, (?:uniform|zipf (?P<zipf_alpha>[0-9.]+))(?:, (?P<optimizer>\w+))?$"
)


def config_of(row: Dict[str, Any]) -> Optional[Config]:
    """The row's configuration: its ``config``, else the one its label names (rows
    copied from a printed table have only the label), else None."""
    if "config" in row:
        return Config(**row["config"])
    m = _LABEL.match(row.get("label", ""))
    if m is None:
        return None
    ints = {k: int(v) for k, v in m.groupdict().items() if k not in ("zipf_alpha", "optimizer")}
    return Config(**ints, zipf_alpha=float(m["zipf_alpha"] or 0.0), optimizer=m["optimizer"] or "sgd")


def row_key(row: Dict[str, Any]) -> Tuple[str, ...]:
    """What tells a row from the others of several results files (the same scenario
    and label recur over files: leases, trees)."""
    return (row.get("source", ""), row["scenario"], row["label"], *row["pair"])


def remote_path(row: Dict[str, Any]) -> str:
    """Our side's ``PgasOptions.remote_path`` in the row's run (rows of results files
    written before the benchmark recorded its options ran the default, ``auto``)."""
    return row.get("options", {}).get("remote_path", "auto")


def _rows(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = [r for r in results.get("rows", []) if "baseline" in r and "ours" in r and config_of(r) is not None]
    if not rows:
        raise ValueError("the results file has no rows with a 'config' (run `python -m torchrec_pgas.benchmark`)")
    return rows


def load(paths: Sequence[str]) -> Dict[str, Any]:
    """The rows of several results files together, each tagged with its file's name
    (``source``)."""
    rows: List[Dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            rows += [dict(r, source=os.path.basename(path)) for r in json.load(f).get("rows", [])]
    return {"rows": rows}


def intra_gbps(results: Dict[str, Any]) -> Tuple[float, str]:
    """The NVLink bandwidth to project with, and where it comes from: the results' own
    device-initiated measurement if they have one, else ``DEFAULT_INTRA_GBPS``."""
    measured = [r["link_gbps"] for r in _rows(results) if r.get("link_gbps")]
    if measured:
        return max(measured), "measured in the results' run (device-initiated put+signal)"
    return DEFAULT_INTRA_GBPS, "stated (device-initiated put+signal on 2 x H200; not in the results file)"


def fit_results(results: Dict[str, Any], links: Links, fit_scenarios: Sequence[str] = ("r1",)) -> List[Pair]:
    """Per sharding pair: both implementations fitted on the rows of ``fit_scenarios``
    (all rows of the pair if it has none) of the default remote path, at the rows'
    measured copy bandwidth; the projection starts from the first of them."""
    rows = _rows(results)
    pairs = []
    for names in dict.fromkeys(tuple(r["pair"]) for r in rows):
        # The model's link is the peer mappings' stores: rows of the put path are checked, never fitted on.
        mine = [r for r in rows if tuple(r["pair"]) == names and remote_path(r) == "auto"]
        if not mine:
            continue
        chosen = [r for r in mine if r["scenario"] in fit_scenarios] or mine
        copy = [r["copy_gbps"] for r in chosen if r.get("copy_gbps")]
        if not copy:
            raise ValueError(f"no row of the pair {names} fitted on has a measured copy bandwidth ('copy_gbps')")
        lookup = statistics.median(copy)
        points = lambda side: [(config_of(r), r[side]["forward_ms"]) for r in chosen]  # noqa: E731
        pairs.append(
            Pair(
                names=names,
                base=config_of(next((r for s in fit_scenarios for r in chosen if r["scenario"] == s), chosen[0])),
                theirs=fit(points("baseline"), lookup, overlapped=False, links=links),
                ours=fit(points("ours"), lookup, overlapped=True, links=links),
                fitted_on=tuple(row_key(r) for r in chosen),
            )
        )
    if not pairs:
        raise ValueError("no row to fit on: every row ran on the put path (--remote-path put); fit on a default run")
    return pairs


def check(results: Dict[str, Any], pairs: List[Pair], links: Links) -> List[Dict[str, Any]]:
    """The model against every measured row of the results that it can model (a row
    with a configuration, of a fitted pair), per side: ``ratio`` is model / measured.

    A row's own bandwidths, measured in its run, replace the fit's and the stated ones
    where it has them: the lookup at its ``copy_gbps``, NVLink at its ``link_gbps``
    (device-initiated put+signal; rows of older trees have none)."""
    fitted = {p.names: p for p in pairs}
    out = []
    for r in _rows(results):
        pair = fitted.get(tuple(r["pair"]))
        if pair is None:
            continue
        cfg = config_of(r)
        row_links = dataclasses.replace(links, intra_gbps=r["link_gbps"]) if r.get("link_gbps") else links
        for side, model in (("baseline", pair.theirs), ("ours", pair.ours)):
            if r.get("copy_gbps"):
                model = dataclasses.replace(model, lookup_gbps=r["copy_gbps"])
            measured, predicted = r[side]["forward_ms"], forward_ms(cfg, model, row_links)
            out.append(
                {
                    "source": r.get("source", ""),
                    "row": f"{r['scenario']}: {r['label']}",
                    "pair": r["pair"],
                    "side": side,
                    "gpus": cfg.ranks,
                    "remote_path": remote_path(r),
                    "measured_ms": measured,
                    "model_ms": predicted,
                    "ratio": predicted / measured,
                    "rel_error": (predicted - measured) / measured,
                    "copy_gbps": model.lookup_gbps,
                    "copy_measured": bool(r.get("copy_gbps")),
                    "fitted": row_key(r) in pair.fitted_on,
                }
            )
    return out


def not_modelled(results: Dict[str, Any], pairs: List[Pair]) -> List[str]:
    """The rows ``check`` leaves out, each with why."""
    fitted = {p.names for p in pairs}
    out = []
    for r in results.get("rows", []):
        pair = " vs ".join(r.get("pair", []))
        where = f"{r.get('source', '')}: {r.get('scenario', '?')}: {r.get('label', '?')} ({pair})"
        if config_of(r) is None:
            out.append(f"{where}: no configuration (no 'config', and a label that names none)")
        elif tuple(r.get("pair", ())) not in fitted:
            out.append(f"{where}: its pair has no fit")
    return out


def _worst(ratios: Sequence[float]) -> float:
    """The ratio farthest from 1 (in either direction: 0.5 is as far as 2)."""
    return max(ratios, key=lambda x: abs(math.log(x)))


def summarize(checked: List[Dict[str, Any]], tolerance: float) -> List[Dict[str, Any]]:
    """Per side, GPU count and our side's remote path (TorchRec's rows of a run on the put
    path are under it too: the same run), over the held-out rows and over all: how many rows,
    the median and the worst ratio, and how many are off by more than ``tolerance``
    (``outside``: a ratio above ``1 + tolerance`` or below ``1 / (1 + tolerance)``)."""
    out = []
    paths = sorted({c.get("remote_path", "auto") for c in checked})
    for side in ("baseline", "ours"):
        for gpus, path in [(g, p) for g in sorted({c["gpus"] for c in checked}) for p in paths]:
            for which in ("held out", "all"):
                ratios = [
                    c["ratio"]
                    for c in checked
                    if c["side"] == side
                    and c["gpus"] == gpus
                    and c.get("remote_path", "auto") == path
                    and (which == "all" or not c["fitted"])
                ]
                if ratios:
                    out.append(
                        {
                            "side": side,
                            "gpus": gpus,
                            "remote_path": path,
                            "rows": which,
                            "n": len(ratios),
                            "median_ratio": statistics.median(ratios),
                            "worst_ratio": _worst(ratios),
                            "outside": sum(off(x, tolerance) for x in ratios),
                        }
                    )
    return out


def off(ratio: float, tolerance: float) -> bool:
    """Whether a model / measured ratio is off by more than ``tolerance`` (either way)."""
    return abs(math.log(ratio)) > math.log1p(tolerance)


_SIDE = {"baseline": "TorchRec (NCCL)", "ours": "ours"}


def check_markdown(
    checked: List[Dict[str, Any]],
    left_out: List[str],
    links: Links,
    source: str,
    fitted_on: str,
    tolerance: float,
    command: str,
) -> str:
    """The check as a report: the summary first, then every row."""
    lines = [
        f"# The {LABEL} checked against measured forwards",
        "",
        f"Generated by `{command}` (it reads results files only).",
        "",
        "Ratio = model / measured forward time (above 1: the model is slower than the measurement). "
        f"Fitted on: {fitted_on}. NVLink {links.intra_gbps:.0f} GB/s per GPU and "
        f"direction ({source}) unless a row measured its own; the lookup at each row's measured copy "
        f"bandwidth where it has one, else at the fit's. Rows off by more than {tolerance:.0%} "
        "(either way) are marked **off**.",
        "",
        f"## Summary: {LABEL} / measured",
        "",
        f"| side | GPUs | our remote path | rows | n | median ratio | worst ratio | off by more than {tolerance:.0%} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summarize(checked, tolerance):
        lines.append(
            f"| {_SIDE[s['side']]} | {s['gpus']} | {s['remote_path']} | {s['rows']} | {s['n']} | "
            f"{s['median_ratio']:.2f} | {s['worst_ratio']:.2f} | {s['outside']} |"
        )
    lines += [
        "",
        "By results file (each a run on one lease; the model has no term for the host's speed):",
        "",
        "| file | side | n | median ratio | worst ratio |",
        "|---|---|---|---|---|",
    ]
    for source in dict.fromkeys(c["source"] for c in checked):
        for side in ("baseline", "ours"):
            ratios = [c["ratio"] for c in checked if c["source"] == source and c["side"] == side]
            lines.append(
                f"| {source} | {_SIDE[side]} | {len(ratios)} | {statistics.median(ratios):.2f} | {_worst(ratios):.2f} |"
            )
    lines += [
        "",
        "How to read it: the model's data-dependent terms are the lookup (at the copy bandwidth) and the "
        "link; everything else is one fixed time per implementation (plus one exchange time on more "
        "than one GPU), fitted on the rows marked 'fitted on'. Host time, most of a step at these sizes, "
        "moves between leases and, on one GPU, with the batch in no monotonic way: the model cannot "
        "follow it, so the spread of the ratios is mostly the host's. The model's link is the peer "
        "mappings' stores inside a node (`PgasOptions.remote_path='auto'`); the put path (`'put'`, "
        "the code that runs between nodes, forced inside one by the benchmark's `--remote-path put`) "
        "crosses the same NVLink, so the model gives it the same time: its rows are never fitted on, "
        "and their ratios are what the put path costs beyond the model. "
        + (
            f"Rows on the put path here: {sum(c.get('remote_path') == 'put' for c in checked) // 2}."
            if any(c.get("remote_path") == "put" for c in checked)
            else "No row here ran on the put path (files from before the benchmark recorded its "
            "options ran the default), so that mode is not checked yet."
        ),
    ]
    lines += [
        "",
        f"## Every row: {LABEL} against measured",
        "",
        "| file | row | pair | side | GPUs | measured ms | model ms | ratio | lookup GB/s | |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in checked:
        mark = " **off**" if off(c["ratio"], tolerance) else ""
        copy = f"{c['copy_gbps']:.0f}" + ("" if c["copy_measured"] else " (fit's)")
        lines.append(
            f"| {c['source']} | {c['row']} | {c['pair'][1]} vs {c['pair'][0]} | {_SIDE[c['side']]} | {c['gpus']} | "
            f"{c['measured_ms']:.3f} | {c['model_ms']:.3f} | {c['ratio']:.2f}{mark} | {copy} | "
            f"{'fitted on' if c['fitted'] else 'held out'} |"
        )
    if left_out:
        lines += ["", "Not modelled:", ""] + [f"- {w}" for w in left_out]
    return "\n".join(lines) + "\n"


def project(pairs: List[Pair], links: Links, nodes: Sequence[int] = NODES) -> List[Dict[str, Any]]:
    """The model's forward for every pair, scaling mode and node count."""
    out = []
    for pair in pairs:
        for mode in MODES:
            for n in nodes:
                cfg = scaled(pair.base, mode, n * links.gpus_per_node)
                theirs, ours = forward_ms(cfg, pair.theirs, links), forward_ms(cfg, pair.ours, links)
                out.append(
                    {
                        "pair": list(pair.names),
                        "mode": mode,
                        "nodes": n,
                        "gpus": cfg.ranks,
                        "batch_per_gpu": cfg.batch_size,
                        "theirs_ms": theirs,
                        "ours_ms": ours,
                    }
                )
    return out


def markdown(
    pairs: List[Pair], links: Links, source: str, checked: List[Dict[str, Any]], projected: List[Dict[str, Any]]
) -> str:
    lines = [
        f"# Embedding forward on 1 to {max(NODES)} nodes: {LABEL}",
        "",
        f"Analytic model (`torchrec_pgas/benchmark/projection.py`), fitted on single-node measurements; "
        f"nothing beyond one node was run. NVLink {links.intra_gbps:.0f} GB/s per GPU and direction ({source}); "
        f"inter-node {links.inter_gbps:.0f} GB/s per GPU; {links.gpus_per_node} GPUs per node; per peer "
        f"{links.pgas_peer_ms * 1e3:.1f} us (ours), {links.nccl_peer_ms * 1e3:.1f} us per all-to-all (NCCL).",
        "",
    ]
    for pair in pairs:
        lines.append(
            f"- {pair.names[1]}: fixed {pair.ours.fixed_ms:.3f} ms + exchange {pair.ours.exchange_ms:.3f} ms; "
            f"{pair.names[0]}: fixed {pair.theirs.fixed_ms:.3f} ms + exchange {pair.theirs.exchange_ms:.3f} ms; "
            f"lookup at {pair.ours.lookup_gbps:.0f} GB/s; base "
            f"{pair.base.label()}; fitted on {len(pair.fitted_on)} row(s)"
        )
    for mode in MODES:
        what = "samples per GPU fixed" if mode == "weak" else "global batch fixed"
        lines += [
            "",
            f"## {mode.capitalize()} scaling ({what}): {LABEL}",
            "",
            "| pair | nodes | GPUs | samples/GPU | TorchRec ms | ours ms | TorchRec / ours |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in (p for p in projected if p["mode"] == mode):
            lines.append(
                f"| {p['pair'][1]} vs {p['pair'][0]} | {p['nodes']} | {p['gpus']} | {p['batch_per_gpu']} | "
                f"{p['theirs_ms']:.3f} | {p['ours_ms']:.3f} | {p['theirs_ms'] / p['ours_ms']:.2f}x |"
            )
    lines += [
        "",
        f"## Check of the model against the measured rows ({LABEL})",
        "",
        "| row | pair | side | GPUs | measured ms | model ms | error | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in checked:
        lines.append(
            f"| {c['row']} | {c['pair'][1]} vs {c['pair'][0]} | {c['side']} | {c['gpus']} | "
            f"{c['measured_ms']:.3f} | {c['model_ms']:.3f} | {c['rel_error']:+.1%} | "
            f"{'fitted on' if c['fitted'] else 'held out'} |"
        )
    return "\n".join(lines) + "\n"


def plot(projected: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODES), figsize=(10, 4), squeeze=False)
    for ax, mode in zip(axes[0], MODES):
        mine = [p for p in projected if p["mode"] == mode]
        for i, names in enumerate(dict.fromkeys(tuple(p["pair"]) for p in mine)):
            points = [p for p in mine if tuple(p["pair"]) == names]
            nodes = [p["nodes"] for p in points]
            ax.plot(nodes, [p["ours_ms"] for p in points], "-o", color=f"C{i}", label=f"{names[1]} (model)")
            ax.plot(nodes, [p["theirs_ms"] for p in points], "--s", color=f"C{i}", label=f"{names[0]}, NCCL (model)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(NODES))
        ax.set_xticklabels([str(n) for n in NODES])
        ax.set_xlabel("nodes of 8 GPUs")
        ax.set_ylabel("forward ms")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{mode} scaling: {LABEL}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"Embedding forward, {LABEL}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _without_output(argv: "Sequence[str] | None") -> List[str]:
    """The command's arguments but where it writes: what the check's report records."""
    out: List[str] = []
    skip = False
    for word in sys.argv[1:] if argv is None else argv:
        if not skip and word != "--check-md" and not word.startswith("--check-md="):
            out.append(word)
        skip = word == "--check-md"
    return out


def main(argv: "Sequence[str] | None" = None) -> None:
    p = argparse.ArgumentParser(description=f"Embedding forward on 1 to 16 nodes: {LABEL}")
    p.add_argument(
        "--results",
        nargs="+",
        help="results.json of `python -m torchrec_pgas.benchmark` (several: their rows together) to fit on",
    )
    p.add_argument("--out", help="directory for projection.md and projection.png")
    p.add_argument(
        "--check",
        nargs="+",
        metavar="RESULTS",
        help="results files to check the model against, row by row (fitted on --results, else on these)",
    )
    p.add_argument("--check-md", help="where to write the check's markdown (it is printed in any case)")
    p.add_argument("--tolerance", type=float, default=0.25, help="a check's ratio off by more than this is marked")
    p.add_argument("--strict", action="store_true", help="exit 1 if any checked row is off by more than --tolerance")
    p.add_argument(
        "--fit-scenarios",
        default="r1",
        help="comma-separated scenarios whose rows the model is fitted on (the rest are held out)",
    )
    p.add_argument("--intra-gbps", type=float, help="NVLink GB/s per GPU and direction (default: see intra_gbps)")
    p.add_argument("--inter-gbps", type=float, default=Links.inter_gbps, help="inter-node GB/s per GPU")
    p.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node)
    p.add_argument("--pgas-peer-ms", type=float, default=Links.pgas_peer_ms)
    p.add_argument("--nccl-peer-ms", type=float, default=Links.nccl_peer_ms)
    args = p.parse_args(argv)
    if not args.check and not (args.results and args.out):
        p.error("give --results and --out (the projection), or --check (the check against measured rows)")
    if args.tolerance <= 0:
        p.error(f"--tolerance must be positive (a fraction: 0.25 is 25%), got {args.tolerance}")
    fit_paths = args.results or args.check
    results = load(fit_paths)
    intra, source = (args.intra_gbps, "given") if args.intra_gbps else intra_gbps(results)
    links = Links(intra, args.inter_gbps, args.gpus_per_node, args.pgas_peer_ms, args.nccl_peer_ms)
    scenarios = args.fit_scenarios.split(",")
    pairs = fit_results(results, links, scenarios)
    if args.check:
        args.check = sorted(args.check, key=os.path.basename)  # the table's order, whatever the shell's
        measured = load(args.check)
        checked = check(measured, pairs, links)
        fitted_on = f"the {'/'.join(scenarios)} rows of {', '.join(os.path.basename(f) for f in fit_paths)}"
        command = " ".join(["python -m torchrec_pgas.benchmark.projection", *_without_output(argv)])
        table = check_markdown(
            checked, not_modelled(measured, pairs), links, source, fitted_on, args.tolerance, command
        )
        if args.check_md:
            with open(args.check_md, "w") as f:
                f.write(table)
        print(table)
        bad = [c for c in checked if off(c["ratio"], args.tolerance)]
        if args.strict and bad:
            sys.exit(f"{len(bad)} of {len(checked)} checked rows off by more than {args.tolerance:.0%} ({LABEL})")
        return
    checked, projected = check(results, pairs, links), project(pairs, links)
    os.makedirs(args.out, exist_ok=True)
    table = markdown(pairs, links, source, checked, projected)
    with open(os.path.join(args.out, "projection.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "projection.json"), "w") as f:
        json.dump(
            {"label": LABEL, "links": dataclasses.asdict(links), "check": checked, "projection": projected}, f, indent=1
        )
    plot(projected, os.path.join(args.out, "projection.png"))
    print(table)


if __name__ == "__main__":
    main()
