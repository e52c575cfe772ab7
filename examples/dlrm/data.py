"""Batches for the example: TorchRec's random data, or Criteo's TSV format.

Criteo TSV (one sample a line): ``label \\t 13 integer features \\t 26 categorical
features as hex strings``; empty fields are allowed. Integers go through
``log(1 + max(x, 0))``, categories are hashed into the tables' rows. Each rank reads
every ``world``-th line, so ranks see disjoint samples; every tenth line is held out
for evaluation (``held_out=True``) and never trained on.
"""

import itertools
import math
from typing import Iterator, List

import torch
from model import DENSE_FEATURES
from torchrec import KeyedJaggedTensor
from torchrec.datasets.random import RandomRecDataset
from torchrec.datasets.utils import Batch


def random_batches(keys: List[str], batch_size: int, rows: int, seed: int) -> Iterator[Batch]:
    return iter(
        RandomRecDataset(
            keys=keys,
            batch_size=batch_size,
            hash_size=rows,
            ids_per_feature=4,
            num_dense=DENSE_FEATURES,
            manual_seed=seed,
        )
    )


def _parse(line: str, keys: List[str], rows: int):
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 1 + DENSE_FEATURES + 26:
        raise ValueError(f"a Criteo TSV line has {1 + DENSE_FEATURES + 26} fields, got {len(fields)}")
    label = float(fields[0])
    dense = [math.log1p(max(float(x), 0.0)) if x else 0.0 for x in fields[1 : 1 + DENSE_FEATURES]]
    cats = fields[1 + DENSE_FEATURES :]
    ids = [[int(c, 16) % rows] if c else [] for c in cats[: len(keys)]]
    return label, dense, ids


def criteo_batches(
    path: str, keys: List[str], batch_size: int, rows: int, rank: int, world: int, held_out: bool = False
) -> Iterator[Batch]:
    """Endless batches from a Criteo TSV file (it is read again from the start)."""
    while True:
        with open(path) as f:
            split = (line for i, line in enumerate(f) if (i % 10 == 9) == held_out)
            lines = itertools.islice(split, rank, None, world)
            while chunk := list(itertools.islice(lines, batch_size)):
                if len(chunk) < batch_size:
                    break
                parsed = [_parse(line, keys, rows) for line in chunk]
                ids_by_key = [[p[2][k] for p in parsed] for k in range(len(keys))]
                yield Batch(
                    dense_features=torch.tensor([p[1] for p in parsed]),
                    sparse_features=KeyedJaggedTensor(
                        keys=keys,
                        values=torch.tensor([i for bags in ids_by_key for bag in bags for i in bag], dtype=torch.int64),
                        lengths=torch.tensor([len(bag) for bags in ids_by_key for bag in bags], dtype=torch.int64),
                    ),
                    labels=torch.tensor([p[0] for p in parsed]),
                )
