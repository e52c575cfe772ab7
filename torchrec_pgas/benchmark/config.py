"""What one benchmark configuration is, and the scenarios that vary it."""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Dict, List


@dataclass(frozen=True)
class Config:
    """One workload: ``tables`` tables (over ``ranks`` ranks) of ``rows`` x ``dim`` fp32,
    ``batch_size`` samples per rank, ``ids_per_bag`` ids per sample and table, ids drawn
    uniformly or from a Zipf law (``zipf_alpha`` > 0)."""

    tables: int = 8
    rows: int = 1_000_000
    dim: int = 128
    batch_size: int = 8192
    ids_per_bag: int = 20
    zipf_alpha: float = 0.0
    ranks: int = 2

    def label(self) -> str:
        ids = f"zipf {self.zipf_alpha}" if self.zipf_alpha else "uniform"
        return (
            f"{self.ranks} ranks, {self.tables} x {self.rows} x {self.dim}, "
            f"{self.batch_size}/rank, {self.ids_per_bag} ids/bag, {ids}"
        )


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The base configuration (reference config R1 by default)."""
    base = Config()
    p.add_argument("--tables", type=int, default=base.tables)
    p.add_argument("--rows", type=int, default=base.rows)
    p.add_argument("--dim", type=int, default=base.dim)
    p.add_argument("--batch-size", type=int, default=base.batch_size, help="samples per rank")
    p.add_argument("--ids-per-bag", type=int, default=base.ids_per_bag)
    p.add_argument("--zipf-alpha", type=float, default=0.0, help="0: uniform ids")


def base_config(args: argparse.Namespace, world: int) -> Config:
    return Config(args.tables, args.rows, args.dim, args.batch_size, args.ids_per_bag, args.zipf_alpha, world)


def _world_sizes(world: int) -> List[int]:
    return [w for w in (1, 2, 4, 8, 16) if w <= world]


def scenarios(base: Config, world: int) -> Dict[str, List[Config]]:
    """Every scenario's configurations, from the base (R1 at the default arguments):

    * ``r1``: the base on every rank;
    * ``weak``: tables per rank and samples per rank fixed as ranks grow;
    * ``strong``: the base's tables and global batch fixed as ranks grow;
    * ``dim``, ``ids_per_bag``, ``batch_size``: sweeps of one parameter;
    * ``zipf``: ids from a Zipf law with alpha 1.05 instead of uniform;
    * ``large_tables``: 4 tables of 10 times the base's rows (4 x 10M at R1), the size
      row-wise sharding is for.
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
    }
