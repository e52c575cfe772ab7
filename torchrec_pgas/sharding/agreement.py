"""Checks that every rank shards a module from the same tables, plan and options.

Each rank builds its sharded module from its own copy of the model and plan, and the
exchanges trust what the peers send (an owner's GPU lookup does not check ids again):
a rank that saw a table one row larger than its owner would send ids past the owner's
rows, and one whose plan could not be served would raise alone while its peers wait in
the next collective. So the ranks compare their views once, when a module is sharded,
and all raise the same error.
"""

import dataclasses
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from torchrec_pgas.types import PgasOptions


def table_description(config: Any, weighted: bool, placement: str) -> str:
    """One table (``config``: TorchRec's table config, in a module that takes per-sample
    weights or not) as every rank must see it, with its ``placement`` said by the caller."""
    weighted = ", weighted" if weighted else ""
    return (
        f"'{config.name}': {config.num_embeddings} rows x {config.embedding_dim} {config.data_type.name}, "
        f"{config.pooling.name} pooling{weighted} of {list(config.feature_names)}, {placement}"
    )


def plan_placement(sharding: Any) -> str:
    """Where a ``ParameterSharding`` puts its table: type, kernel, ranks, row blocks."""
    shards = sharding.sharding_spec.shards if sharding.sharding_spec is not None else []
    rows = f" in rows {[s.shard_sizes[0] for s in shards]}" if len(shards) > 1 else ""
    return f"{sharding.sharding_type} ({sharding.compute_kernel}) on ranks {sharding.ranks}{rows}"


def check_ranks_agree(
    options: PgasOptions, tables: List[str], pg: dist.ProcessGroup, name: str, problem: Optional[str] = None
) -> None:
    """Raises the same ``ValueError`` on every rank if the ranks' ``PgasOptions`` or
    tables (``tables``: each described in full, in order) differ, or if any rank has a
    ``problem`` with its plan, naming what differs: buffers sized and ids checked by
    different views of the model would not match (a rank would read past a table its
    peer thinks larger, or wait for ids its peer never sends). One collective, once."""
    everyone: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, (dataclasses.asdict(options), list(tables), problem), group=pg)
    ranks_with: Dict[str, List[int]] = {}
    for r, (_, _, p) in enumerate(everyone):
        if p is not None:
            ranks_with.setdefault(p, []).append(r)
    found = [
        f"{'every rank' if len(ranks) == len(everyone) else 'rank ' + ', '.join(map(str, ranks))}: {p}"
        for p, ranks in ranks_with.items()
    ]
    optioned = [o for o, _, _ in everyone]
    differing = [
        f"{field} ({', '.join(f'rank {r}: {o[field]!r}' for r, o in enumerate(optioned))})"
        for field in optioned[0]
        if any(o[field] != optioned[0][field] for o in optioned)
    ]
    if differing:
        found.append(f"PgasOptions differ across ranks in {'; '.join(differing)}: pass every rank the same options")
    tabled = [t for _, t, _ in everyone]
    if any(t != tabled[0] for t in tabled):
        found.append(
            f"the tables differ across ranks ({_first_difference(tabled)}): build the same model and plan on every rank"
        )
    if found:
        raise ValueError(f"{name}: {'; '.join(found)}")


def _first_difference(tabled: List[List[str]]) -> str:
    """Where the ranks' table lists first differ, each rank's table there."""
    longest = max(len(t) for t in tabled)
    at = next(i for i in range(longest) if len({tuple(t[i : i + 1]) for t in tabled}) > 1)
    seen = [f"rank {r}: {t[at] if at < len(t) else f'no table #{at} ({len(t)} tables)'}" for r, t in enumerate(tabled)]
    return f"table #{at}: {'; '.join(seen)}"
