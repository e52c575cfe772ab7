"""Batches in the model's feature order: a module whose tables are all in one PGAS
sharding hands them to the sharding unpermuted (its exchange routes each feature), and
the other modules take TorchRec's permute and split. Either way the same results, on
real gloo process groups, against TorchRec's own sharding and a float64 reference."""

import functools
from typing import Dict, List

import pytest
import torch
from dist_utils import (
    assert_close_to_reference,
    assert_same_kt,
    pgas_tw,
    reference_pooled,
    run_ranks,
    shard,
    torchrec_tw,
    tw_placement,
)
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding.tw_base import PgasInputError
from torchrec_pgas.sharding_plan import pgas_row_wise
from torchrec_pgas.types import PgasOptions

pgas_rw = functools.partial(pgas_row_wise, compute_kernel="fused")


def _tables(shared: bool) -> List[EmbeddingBagConfig]:
    """Three tables; with ``shared``, a third one also pools f0, with fewer rows."""
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=12, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=30, feature_names=["f2"]),
    ]
    if shared:
        tables.append(EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=7, feature_names=["f0"]))
    return tables


def _batch(tables: List[EmbeddingBagConfig], keys: List[str], batch_size: int, seed: int) -> KeyedJaggedTensor:
    """Keys in the given order, ids valid for every table that pools their feature,
    empty bags."""
    g = torch.Generator().manual_seed(seed)
    rows: Dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    lengths = [torch.randint(0, 4, (batch_size,), generator=g) for _ in keys]
    values = [torch.randint(0, rows[k], (int(n.sum()),), generator=g) for k, n in zip(keys, lengths)]
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _model(tables, placement, world_size):
    torch.manual_seed(5)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(options=PgasOptions(timeout_s=20, headroom=4.0))
    return ref, shard(ref, placement, world_size, sharder)


def _table_wise_in_batch_order(rank, world_size):
    tables = _tables(shared=True)
    order = ["f2", "f0", "f1"]
    ref, pgas = _model(tables, tw_placement(tables, [1, 0, 1], pgas_tw), world_size)
    _, tw = _model(tables, tw_placement(tables, [1, 0, 1], torchrec_tw), world_size)
    for step in range(3):
        kjt = _batch(tables, order, [3, 6][rank] + step, 10 * step + rank)
        out = pgas(kjt)
        assert_same_kt(out, tw(kjt), exact=True)
        assert_close_to_reference(out.to_dict(), reference_pooled(tables, ref.state_dict(), kjt))
    sharded = pgas.module.ebc
    assert sharded._pgas_direct and sharded._embedding_shardings[0]._exchange._reordered
    # An id valid for t0 but not for t2, which also pools f0: checked against the smaller.
    # Two samples: one id of f2 and one of f0 in the first.
    bad = KeyedJaggedTensor(
        keys=order, values=torch.tensor([3, 7 if rank == 1 else 6]), lengths=torch.tensor([1, 0, 1, 0, 0, 0])
    )
    with pytest.raises(PgasInputError, match="rank 1 sent id 7 for feature 'f0' of table 't2', which has 7 rows"):
        pgas(bad)
    # The first batch's order is the model's: another order is refused on every rank.
    other = _batch(tables, ["f0", "f1", "f2"], 4, rank)
    with pytest.raises(PgasInputError, match="features are not the model's"):
        pgas(other if rank == 0 else _batch(tables, order, 4, rank))
    kjt = _batch(tables, order, 5, 99 + rank)
    assert_same_kt(pgas(kjt), tw(kjt), exact=True)


def test_table_wise_takes_batches_in_their_order_unpermuted():
    run_ranks(_table_wise_in_batch_order, 2)


@pytest.mark.parametrize(
    "kinds,order,direct",
    [
        (("rw", "rw"), ["f0", "f1", "f2"], True),  # the sharding's own order
        (("rw", "rw"), ["f2", "f0", "f1"], True),  # the host routing permutes it
        (("tw", "rw"), ["f2", "f0", "f1"], True),  # two PGAS shardings: each picks its own
    ],
    ids=["row-wise-in-order", "row-wise-reordered", "mixed"],
)
def test_row_wise_and_mixed_modules_take_batches_in_their_order(kinds, order, direct):
    run_ranks(_other_modules, 2, kinds=kinds, order=order, direct=direct)


def _other_modules(rank, world_size, kinds, order, direct):
    tables = _tables(shared=False)
    gens = {"tw": lambda: pgas_tw(1), "rw": pgas_rw}
    ref, pgas = _model(tables, {t.name: gens[k]() for t, k in zip(tables, kinds)}, world_size)
    rw = [t.name for t, k in zip(tables, kinds) if k == "rw"]
    for step in range(3):
        kjt = _batch(tables, order, [4, 2][rank] + step, 10 * step + rank)
        out = pgas(kjt).to_dict()
        assert_close_to_reference(out, reference_pooled(tables, ref.state_dict(), kjt, row_wise=rw))
    assert pgas.module.ebc._pgas_direct is direct


def _first_batch_torn_on_one_rank(rank, world_size):
    tables = _tables(shared=False)
    ref, pgas = _model(tables, tw_placement(tables, [1, 0], pgas_tw), world_size)
    order = ["f2", "f0", "f1"]
    first = _batch(tables, order, 4, rank)
    if rank == 1:  # one value fewer than the lengths say
        first = KeyedJaggedTensor(keys=order, values=first.values()[:-1], lengths=first.lengths())
    with pytest.raises(PgasInputError, match="rank 1 sent a KJT whose lengths and values disagree"):
        pgas(first)
    assert pgas.module.ebc._pgas_direct
    kjt = _batch(tables, order, 3, 7 + rank)
    assert_close_to_reference(pgas(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt))


def test_a_torn_first_batch_raises_on_every_rank():
    run_ranks(_first_batch_torn_on_one_rank, 2)


def _orders_differ_across_ranks(rank, world_size, extra):
    """The direct way only if every rank's first batch has the same keys in the same
    order: a problem's detail names a feature by its position in the batch."""
    tables = _tables(shared=True)
    ref, pgas = _model(tables, tw_placement(tables, [1, 0, 1], pgas_tw), world_size)
    order = ["f0", "f1", "f2"] if rank == 0 or extra else ["f2", "f1", "f0"]
    keys = order + (["unused"] if extra and rank == 1 else [])
    kjt = _batch(
        tables + [EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=5, feature_names=["unused"])],
        keys,
        3,
        rank,
    )
    out = pgas(kjt).to_dict()
    assert_close_to_reference(
        out, reference_pooled(tables, ref.state_dict(), kjt.permute([keys.index(k) for k in order]))
    )
    assert pgas.module.ebc._pgas_direct is False
    # Rank 1's first id of f0 is out of range for t2, which also pools f0.
    lengths = {k: [1, 0] if k == "f0" else [0, 0] for k in keys}
    bad = KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor([7 if rank == 1 else 0]),
        lengths=torch.tensor([n for k in keys for n in lengths[k]]),
    )
    with pytest.raises(PgasInputError, match="rank 1 sent id 7 for feature 'f0' of table 't2', which has 7 rows"):
        pgas(bad)


@pytest.mark.parametrize("extra", [False, True], ids=["other-order", "extra-key"])
def test_ranks_with_different_first_batches_take_torchrec_way(extra):
    run_ranks(_orders_differ_across_ranks, 2, extra=extra)


def test_gpu_exchange_routes_orders_of_few_runs_per_owner():
    """An owner's features scattered over more than ``MAX_RUNS`` runs of the batch would
    unroll too many puts: such an order goes TorchRec's way."""
    from torchrec_pgas.sharding.device_routing import MAX_RUNS, TableWiseIds

    def routable(counts, pos):
        return TableWiseIds(counts).routable(pos)

    every_other = lambda n: list(range(0, 2 * n, 2))  # noqa: E731  (n runs of one feature)
    assert routable([MAX_RUNS], every_other(MAX_RUNS))
    assert not routable([MAX_RUNS + 1], every_other(MAX_RUNS + 1))
    assert routable([3, 3 * MAX_RUNS], [5, 6, 7] + list(range(3 * MAX_RUNS)))  # one run each
    assert not routable([2, MAX_RUNS + 1], [0, 1] + every_other(MAX_RUNS + 1))


def _weights_not_one_per_value(rank, world_size, kinds):
    """Weights of another size than the ids, on rank 1: raised on every rank (as the
    first batch, which TorchRec's validator would refuse on rank 1 alone, and later),
    and the next batch is served."""
    tables = _tables(shared=False)
    gens = {"tw": lambda: pgas_tw(1), "rw": pgas_rw}
    torch.manual_seed(5)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=True, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(options=PgasOptions(timeout_s=20, headroom=4.0))
    pgas = shard(ref, {t.name: gens[k]() for t, k in zip(tables, kinds)}, world_size, sharder)
    order = ["f0", "f1", "f2"]

    def batch(seed, torn):
        kjt = _batch(tables, order, 3, seed)
        weights = torch.rand(kjt.values().numel() + (1 if torn else 0))
        return KeyedJaggedTensor(keys=order, values=kjt.values(), lengths=kjt.lengths(), weights=weights)

    for step in range(2):
        with pytest.raises(
            PgasInputError, match=r"rank 1 sent a KJT whose weights and values disagree \(\d+ weights for \d+ values\)"
        ):
            pgas(batch(step * 10 + rank, torn=rank == 1))
        kjt = batch(99 + step + rank, torn=False)
        rw = [t.name for t, k in zip(tables, kinds) if k == "rw"]
        assert_close_to_reference(pgas(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt, row_wise=rw))
    assert pgas.module.ebc._pgas_direct is True


@pytest.mark.parametrize("kinds", [("tw", "tw"), ("tw", "rw")], ids=["one-sharding", "two-shardings"])
def test_weights_not_one_per_value_raise_on_every_rank(kinds):
    run_ranks(_weights_not_one_per_value, 2, kinds=kinds)


def _first_batch_invalid_on_one_rank(rank, world_size):
    """A first batch TorchRec's validator refuses (offsets that are not the running
    sum of the lengths), on rank 1: raised on every rank, and the next batch decides."""
    tables = _tables(shared=False)
    ref, pgas = _model(tables, tw_placement(tables, [1, 0], pgas_tw), world_size)
    order = ["f2", "f0", "f1"]
    first = _batch(tables, order, 4, rank)
    if rank == 1:
        offsets = torch.zeros(first.lengths().numel() + 1, dtype=torch.int64)
        offsets[-1] = first.values().numel()  # every id in the last bag
        first = KeyedJaggedTensor(keys=order, values=first.values(), lengths=first.lengths(), offsets=offsets)
    with pytest.raises(
        PgasInputError, match="rank 1 sent an invalid KJT: offsets is not equal to the cumulative sum of lengths"
    ):
        pgas(first)
    kjt = _batch(tables, order, 3, 7 + rank)
    assert_close_to_reference(pgas(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt))
    assert pgas.module.ebc._pgas_direct


def test_a_first_batch_torchrec_refuses_raises_on_every_rank():
    run_ranks(_first_batch_invalid_on_one_rank, 2)
