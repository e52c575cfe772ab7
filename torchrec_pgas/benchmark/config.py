"""What one benchmark configuration is, and the scenarios that vary it."""

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torchrec_pgas.types import PgasOptions, RemotePath, SparseUpdate

#: Rows of the 26 sparse features of Criteo 1TB with ids hashed into at most 40M
#: (MLPerf DLRM v2, TorchRec's ``examples/dlrm``): from 3 to 40M rows.
CRITEO_ROWS: Tuple[int, ...] = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10,
    2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36,
)  # fmt: skip
#: Ids per sample of the same features in MLPerf DLRM v2's multi-hot Criteo: 1 to 3
#: for most (11 one-hot), a few multi-hot up to 100 (production models' pooling factors).
CRITEO_POOLING: Tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip
#: Tables this small keep all their rows at any ``scale``: a feature of 3 or 10 values
#: has 3 or 10 rows in any model.
MIN_SCALED_ROWS = 16
#: Full-size (unscaled) row count above which the DLRM scenario's plan shards a table
#: row-wise: the 6 tables of 3M to 40M rows, whose size (1.5 to 20 GB at dim 128)
#: would unbalance any table-wise placement. Taken on the full size so that the plan
#: is the same at every ``scale``.
ROW_WISE_ABOVE = 1_000_000
#: The DLRM scenario's default ``scale``: 10M-row largest tables, 26 GB of fp32 rows at
#: dim 128, so that one model fits one H200 next to the benchmark's other buffers.
DEFAULT_SCALE = 0.25
#: On CPUs: 400k-row largest tables, 1 GB of rows per model at dim 128.
CPU_SCALE = 0.01
#: The embeddings' fused optimizers a workload may train with, both sides: FBGEMM's
#: ``EXACT_SGD``, or ``EXACT_ROWWISE_ADAGRAD`` (MLPerf DLRM v2's, TorchRec's DLRM example
#: with ``--adagrad``), which also reads and writes each row's optimizer state.
OPTIMIZERS = ("sgd", "rowwise_adagrad")


@dataclass(frozen=True)
class Config:
    """One workload of ``ranks`` ranks, ``batch_size`` samples per rank, ``dim``-wide
    fp32 tables, ids drawn uniformly or from a Zipf law (``zipf_alpha`` > 0).

    ``shape`` "uniform": ``tables`` tables of ``rows`` rows, ``ids_per_bag`` ids per
    sample and table. ``shape`` "dlrm": the 26 tables of ``CRITEO_ROWS`` times
    ``scale`` with the pooling factors ``CRITEO_POOLING`` (``rows`` and
    ``ids_per_bag`` unused); see ``table_specs``. Training steps update the tables with
    ``optimizer`` (one of ``OPTIMIZERS``)."""

    tables: int = 8
    rows: int = 1_000_000
    dim: int = 128
    batch_size: int = 8192
    ids_per_bag: int = 20
    zipf_alpha: float = 0.0
    ranks: int = 2
    shape: str = "uniform"
    scale: float = 1.0
    optimizer: str = "sgd"

    def label(self) -> str:
        ids = f"zipf {self.zipf_alpha}" if self.zipf_alpha else "uniform"
        if self.optimizer != "sgd":
            ids += f", {self.optimizer}"
        if self.shape == "dlrm":
            specs = table_specs(self)
            rows = sorted(s.rows for s in specs)
            big = sum(s.row_wise for s in specs)
            return (
                f"{self.ranks} ranks, DLRM-shaped {len(specs)} tables of {rows[0]}..{rows[-1]} rows "
                f"(scale {self.scale:g}; {big} row-wise) x {self.dim}, {self.batch_size}/rank, "
                f"{min(CRITEO_POOLING)}..{max(CRITEO_POOLING)} ids/bag, {ids}"
            )
        return (
            f"{self.ranks} ranks, {self.tables} x {self.rows} x {self.dim}, "
            f"{self.batch_size}/rank, {self.ids_per_bag} ids/bag, {ids}"
        )


@dataclass(frozen=True)
class TableSpec:
    """One table of a workload: its rows, ids per sample, and where the plan puts it
    (row-wise over every rank, else table-wise on ``rank``)."""

    rows: int
    ids_per_bag: int
    row_wise: bool
    rank: int


def table_specs(cfg: Config) -> List[TableSpec]:
    """The tables of ``cfg``, with their placement.

    Uniform: every table table-wise, table ``i`` on rank ``i % ranks`` (the row-wise
    pair shards all of them row-wise; the floor takes the table-wise placement).
    DLRM-shaped: the tables above ``ROW_WISE_ABOVE`` full-size rows row-wise, the
    rest table-wise, balanced over the ranks by their lookup traffic (``balance``)."""
    if cfg.shape == "uniform":
        return [TableSpec(cfg.rows, cfg.ids_per_bag, False, i % cfg.ranks) for i in range(cfg.tables)]
    if cfg.shape != "dlrm":
        raise ValueError(f"unknown table shape {cfg.shape!r}: expected 'uniform' or 'dlrm'")
    if not 0 < cfg.scale <= 1:
        raise ValueError(f"the DLRM scenario's scale must be in (0, 1], got {cfg.scale}")
    if cfg.tables != len(CRITEO_ROWS):
        raise ValueError(f"the DLRM scenario has {len(CRITEO_ROWS)} tables, the config says {cfg.tables}")
    rows = [max(min(r, MIN_SCALED_ROWS), math.ceil(r * cfg.scale)) for r in CRITEO_ROWS]
    big = [r > ROW_WISE_ABOVE for r in CRITEO_ROWS]
    small = [i for i in range(len(rows)) if not big[i]]
    owner = balance([CRITEO_POOLING[i] * (cfg.dim * 4 + 8) + cfg.dim * 4 for i in small], cfg.ranks)
    ranks = dict(zip(small, owner))
    return [TableSpec(rows[i], CRITEO_POOLING[i], big[i], ranks.get(i, 0)) for i in range(len(rows))]


def balance(loads: Sequence[float], ranks: int) -> List[int]:
    """An owner rank per item, the heaviest first on the least loaded rank (greedy
    longest-processing-time: within 4/3 of the best makespan)."""
    total = [0.0] * ranks
    owner: List[Optional[int]] = [None] * len(loads)
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        r = min(range(ranks), key=lambda r: (total[r], r))
        owner[i], total[r] = r, total[r] + loads[i]
    return [int(o) for o in owner]  # type: ignore[arg-type]


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The base configuration (reference config R1 by default)."""
    base = Config()
    p.add_argument("--tables", type=int, default=base.tables)
    p.add_argument("--rows", type=int, default=base.rows)
    p.add_argument("--dim", type=int, default=base.dim)
    p.add_argument("--batch-size", type=int, default=base.batch_size, help="samples per rank")
    p.add_argument("--ids-per-bag", type=int, default=base.ids_per_bag)
    p.add_argument("--zipf-alpha", type=float, default=0.0, help="0: uniform ids")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=base.optimizer,
        help="the embeddings' fused optimizer in training steps, both sides",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=None,
        help=f"the dlrm scenario's row counts as a fraction of Criteo 1TB's "
        f"(default {DEFAULT_SCALE} on GPUs, {CPU_SCALE} on CPUs)",
    )
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [int(b) for b in s.split(",")],
        default=None,
        help="comma-separated samples per rank: every chosen scenario's configurations at each",
    )


def add_options_args(p: argparse.ArgumentParser) -> None:
    """Our side's options (``PgasOptions``) that a run may choose."""
    p.add_argument(
        "--sparse-update",
        choices=typing.get_args(SparseUpdate),
        default=PgasOptions().sparse_update,
        help="how our GPU training steps update the tables (PgasOptions.sparse_update)",
    )
    p.add_argument(
        "--remote-path",
        choices=typing.get_args(RemotePath),
        default=PgasOptions().remote_path,
        help="how our GPU side writes into peers (PgasOptions.remote_path): 'put' takes NVSHMEM "
        "puts for every peer, the path between nodes, inside one node too",
    )
    p.add_argument(
        "--headroom",
        type=_headroom,
        default=PgasOptions().headroom,
        help="our buffers' size over the first batch's (PgasOptions.headroom): the fused "
        "update sorts the whole index capacity, so 1 sorts only the first batch's ids",
    )


def _headroom(text: str) -> float:
    try:
        return PgasOptions(headroom=float(text)).headroom
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def pgas_options(args: argparse.Namespace) -> PgasOptions:
    """The ``PgasOptions`` of ``add_options_args``'s arguments."""
    return PgasOptions(sparse_update=args.sparse_update, remote_path=args.remote_path, headroom=args.headroom)


def options_record(options: PgasOptions) -> Dict[str, Any]:
    """The options a results row records (``add_options_args``'), by field."""
    return {"sparse_update": options.sparse_update, "remote_path": options.remote_path, "headroom": options.headroom}


def base_config(args: argparse.Namespace, world: int) -> Config:
    return Config(
        args.tables,
        args.rows,
        args.dim,
        args.batch_size,
        args.ids_per_bag,
        args.zipf_alpha,
        world,
        optimizer=args.optimizer,
    )


def dlrm_config(base: Config, scale: float) -> Config:
    """The DLRM-shaped scenario at the base's dim, batch and ranks; Zipf-skewed ids
    (the base's alpha, else 1.05 as in the ``zipf`` scenario), as in click logs."""
    return dataclasses.replace(
        base, shape="dlrm", scale=scale, tables=len(CRITEO_ROWS), zipf_alpha=base.zipf_alpha or 1.05
    )


def batch_sweep(configs: Sequence[Config], batch_sizes: Sequence[int]) -> List[Config]:
    """Every configuration at every batch size (samples per rank)."""
    if any(b <= 0 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
    return [dataclasses.replace(c, batch_size=b) for c in configs for b in batch_sizes]


def _world_sizes(world: int) -> List[int]:
    return [w for w in (1, 2, 4, 8, 16) if w <= world]


def scenarios(base: Config, world: int, scale: float = DEFAULT_SCALE) -> Dict[str, List[Config]]:
    """Every scenario's configurations, from the base (R1 at the default arguments):

    * ``r1``: the base on every rank;
    * ``weak``: tables per rank and samples per rank fixed as ranks grow;
    * ``strong``: the base's tables and global batch fixed as ranks grow;
    * ``dim``, ``ids_per_bag``, ``batch_size``: sweeps of one parameter;
    * ``zipf``: ids from a Zipf law with alpha 1.05 instead of uniform;
    * ``large_tables``: 4 tables of 10 times the base's rows (4 x 10M at R1), the size
      row-wise sharding is for;
    * ``dlrm``: DLRM-shaped tables at ``scale`` (``dlrm_config``, ``table_specs``).
    """
    per_rank_tables = max(1, base.tables // world)
    global_batch = base.batch_size * world
    sweep = lambda field, values: [dataclasses.replace(base, **{field: v}) for v in values]  # noqa: E731
    return {
        "r1": [base],
        "weak": [dataclasses.replace(base, ranks=w, tables=per_rank_tables * w) for w in _world_sizes(world)],
        "strong": [dataclasses.replace(base, ranks=w, batch_size=global_batch // w) for w in _world_sizes(world)],
        "dim": sweep("dim", [32, 64, 128, 256]),
        "ids_per_bag": sweep("ids_per_bag", [1, 5, 20, 50, 100]),
        "batch_size": sweep("batch_size", [512, 2048, 8192, 32768, 65536]),
        "zipf": [dataclasses.replace(base, zipf_alpha=1.05)],
        "large_tables": [dataclasses.replace(base, tables=4, rows=10 * base.rows)],
        "dlrm": [dlrm_config(base, scale)],
    }
