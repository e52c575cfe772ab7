"""Bad batches on one rank, in modules of one or several sharding types (PGAS ones and
TorchRec's own): every rank raises the same ``PgasInputError`` for that step, and the
next batch is served right (float64 oracle, real gloo process groups). Also the plans
and set-ups that must fail on every rank with a clear message."""

import functools

import pytest
import torch
from dist_utils import assert_close_to_reference, pgas_tw, reference_pooled, run_ranks, shard, torchrec_tw
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.sharding_plan import row_wise

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding.tw_base import PgasInputError
from torchrec_pgas.sharding_plan import pgas_row_wise
from torchrec_pgas.types import PgasOptions

WORLD = 2
pgas_rw = functools.partial(pgas_row_wise, compute_kernel="fused")
torchrec_rw = functools.partial(row_wise, compute_kernel="fused")

#: Placements of t0, t1, t2 (t1 row-wise where the mix has a row-wise type).
MIXES = {
    "pgas_tw+pgas_rw": [pgas_tw(0), pgas_rw(), pgas_tw(1)],
    "pgas_tw+table_wise": [pgas_tw(0), torchrec_tw(1), pgas_tw(1)],
    "pgas_rw+table_wise": [torchrec_tw(0), pgas_rw(), torchrec_tw(1)],
    "pgas_tw alone": [pgas_tw(0), pgas_tw(1), pgas_tw(1)],
    "pgas_rw alone": [pgas_rw(), pgas_rw(), pgas_rw()],
}


def _tables(pooling=PoolingType.SUM):
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=4 * (i + 1), num_embeddings=n, feature_names=[f"f{i}"], pooling=pooling
        )
        for i, n in enumerate([11, 23, 7])
    ]


def _model(mix, weighted=False, pooling=PoolingType.SUM, options=None):
    tables = _tables(pooling)
    torch.manual_seed(3)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(options=options or PgasOptions(timeout_s=30))
    model = shard(ref, {t.name: gen for t, gen in zip(tables, MIXES[mix])}, WORLD, sharder)
    return tables, ref, model


def _good(tables, batch_size, seed, keys=("f0", "f1", "f2"), weighted=False):
    g = torch.Generator().manual_seed(seed)
    rows = {t.feature_names[0]: t.num_embeddings for t in tables}
    lengths = [torch.randint(0, 4, (batch_size,), generator=g) for _ in keys]
    values = [torch.randint(0, rows[k], (int(n.sum()),), generator=g) for k, n in zip(keys, lengths)]
    v = torch.cat(values)
    return KeyedJaggedTensor(
        keys=list(keys),
        values=v,
        lengths=torch.cat(lengths),
        weights=torch.rand(v.numel(), generator=g) if weighted else None,
    )


def _check(model, tables, ref, kjt, mix):
    rw = ["t0", "t1", "t2"] if mix == "pgas_rw alone" else (["t1"] if "rw" in mix else [])
    assert_close_to_reference(model(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt, row_wise=rw))


# ------------------------------------------------------- bad batch on one rank

#: Rank 1's bad batch, and what every rank's error says of it.
BAD = {
    # The example: lengths that add up, one of them negative.
    "negative length": (
        lambda: KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.arange(1, 7), lengths=torch.tensor([-100000, 100002, 1, 1, 1, 1])
        ),
        r"rank 1 .*(negative|lengths and values disagree)",
    ),
    "negative length -1": (
        lambda: KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.arange(1, 7), lengths=torch.tensor([-1, 3, 1, 1, 1, 1])
        ),
        r"rank 1 .*(negative|lengths and values disagree)",
    ),
    "missing key": (
        lambda: KeyedJaggedTensor(keys=["f0", "f1"], values=torch.arange(1, 5), lengths=torch.tensor([1, 1, 1, 1])),
        r"rank 1 .*(lack the model's \['f2'\]|features are not the model's|not those of the first batch|lengths and values disagree)",
    ),
    "duplicate key": (
        lambda: KeyedJaggedTensor(
            keys=["f0", "f1", "f1"], values=torch.arange(1, 7), lengths=torch.tensor([1, 1, 1, 1, 1, 1])
        ),
        r"rank 1 .*(name a feature twice|features are not the model's)",
    ),
    "2-D values": (
        lambda: KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.arange(1, 7).view(6, 1), lengths=torch.tensor([1, 1, 1, 1, 1, 1])
        ),
        r"rank 1 .*(2-D|not 1-D|2 dimensions)",
    ),
    # One feature each: t1 is TorchRec's in "pgas_tw+table_wise" and t0 in
    # "pgas_rw+table_wise" (FBGEMM would raise on their owner alone for a negative id,
    # and serve an id past the table as row 0), PGAS tables' elsewhere.
    "negative id in f1": (
        lambda: KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, -1, 3, 1, 2]), lengths=torch.ones(6, dtype=torch.int64)
        ),
        r"rank 1 .*id -1 for feature 'f1' of table 't1', which has 23 rows",
    ),
    "id past the table in f0": (
        lambda: KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.tensor([1, 11, 2, 3, 1, 2]), lengths=torch.ones(6, dtype=torch.int64)
        ),
        r"rank 1 .*id 11 for feature 'f0' of table 't0', which has 11 rows",
    ),
    # Lengths that do not add up to the values, in a batch of a variable batch size
    # per feature (whose lengths the host check leaves to the exchanges).
    "variable batch, short lengths": (
        lambda: KeyedJaggedTensor(
            keys=["f0", "f1", "f2"],
            values=torch.arange(1, 6),
            lengths=torch.tensor([1, 1, 1]),
            stride_per_key_per_rank=[[1], [1], [1]],
        ),
        r"rank 1 .*(variable batch|varies per feature)",
    ),
    "float ids": (
        lambda: KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.arange(1, 7).float(), lengths=torch.tensor([1, 1, 1, 1, 1, 1])
        ),
        r"rank 1 .*(not integers)",
    ),
}


def _bad_batch_on_rank_1(rank, world_size, mix, case):
    tables, ref, model = _model(mix)
    _check(model, tables, ref, _good(tables, 3 + rank, seed=rank), mix)
    make_bad, message = BAD[case]
    for step in range(2):
        kjt = make_bad() if rank == 1 else _good(tables, 4, seed=10 + step)
        with pytest.raises(PgasInputError, match=message):
            model(kjt)
        # The next good batch is this step's on every rank, and right.
        _check(model, tables, ref, _good(tables, 2 + rank + step, seed=20 + 2 * step + rank), mix)


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("mix", ["pgas_tw+pgas_rw", "pgas_tw+table_wise", "pgas_rw+table_wise"])
def test_a_bad_batch_on_one_rank_raises_on_every_rank_in_mixed_modules(mix, case):
    run_ranks(_bad_batch_on_rank_1, WORLD, mix=mix, case=case, deadline_s=180)


def _shared_feature_ids(rank, world_size):
    # f0 is read by two TorchRec tables of 5 and 20 rows: its ids must be rows of both.
    tables = [
        EmbeddingBagConfig(name="small", embedding_dim=4, num_embeddings=5, feature_names=["f0"]),
        EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=20, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["f1"]),
    ]
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    placement = {"small": torchrec_tw(1), "big": torchrec_tw(0), "t1": pgas_tw(1)}
    model = shard(ref, placement, world_size, PgasEmbeddingBagCollectionSharder(options=PgasOptions(timeout_s=30)))
    ones = torch.ones(4, dtype=torch.int64)
    good = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([4, 0, 8, 3]), lengths=ones)
    assert_close_to_reference(model(good).to_dict(), reference_pooled(tables, ref.state_dict(), good))
    bad = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([7, 0, 8, 3]), lengths=ones)
    with pytest.raises(PgasInputError, match=r"rank 1 .*id 7 for feature 'f0' of table 'small', which has 5 rows"):
        model(bad if rank == 1 else good)
    assert_close_to_reference(model(good).to_dict(), reference_pooled(tables, ref.state_dict(), good))


def test_ids_of_a_feature_two_torchrec_tables_read_are_checked_against_the_smaller():
    run_ranks(_shared_feature_ids, WORLD)


@pytest.mark.parametrize("case", ["negative length", "2-D values", "duplicate key"])
@pytest.mark.parametrize("mix", ["pgas_tw alone", "pgas_rw alone"])
def test_a_bad_batch_on_one_rank_raises_on_every_rank_in_one_type_modules(mix, case):
    run_ranks(_bad_batch_on_rank_1, WORLD, mix=mix, case=case, deadline_s=180)


def _send_fails_on_rank_1(rank, world_size, mix):
    """Any error while a rank prepares its send (here: an injected one) reaches every
    rank, with its type and message, and the next batch is served right."""
    from torchrec_pgas.sharding.tw_exchange import TwExchange

    tables, ref, model = _model(mix)
    _check(model, tables, ref, _good(tables, 3, seed=rank), mix)
    if rank == 1:
        original = TwExchange._check
        calls = []

        def failing(self, *args):
            if not calls:
                calls.append(1)
                raise RuntimeError("injected failure")
            return original(self, *args)

        TwExchange._check = failing
    with pytest.raises(
        PgasInputError, match=r"rank 1 could not send its batch: RuntimeError: injected failure"
    ) as info:
        model(_good(tables, 4, seed=5 + rank))
    if rank == 1:
        assert isinstance(info.value.__cause__, RuntimeError)
    _check(model, tables, ref, _good(tables, 2 + rank, seed=7 + rank), mix)


@pytest.mark.parametrize("mix", ["pgas_tw alone", "pgas_rw alone", "pgas_tw+pgas_rw"])
def test_an_error_preparing_a_send_on_one_rank_raises_on_every_rank(mix):
    run_ranks(_send_fails_on_rank_1, WORLD, mix=mix, deadline_s=180)


# ------------------------------------------------- weights of other float dtypes


def _weights_of_dtype(rank, world_size, mix, dtype, pooling):
    """Half, bfloat16 and float64 per-sample weights are served as float32 ones
    (the slots' dtype), on every path, also in the batch's own feature order."""
    tables, ref, model = _model(mix, weighted=True, pooling=pooling)
    keys = ("f2", "f0", "f1")  # not the sharding's order: the direct path permutes
    for step in range(2):
        kjt = _good(tables, 3 + rank + step, seed=30 + 2 * step + rank, keys=keys, weighted=True)
        kjt = KeyedJaggedTensor(
            keys=list(keys), values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights().to(dtype)
        )
        as_float = KeyedJaggedTensor(
            keys=list(keys), values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights().float()
        )
        rw = ["t0", "t1", "t2"] if mix == "pgas_rw alone" else (["t1"] if "rw" in mix else [])
        assert_close_to_reference(
            model(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), as_float, row_wise=rw)
        )


@pytest.mark.parametrize(
    "mix,dtype,pooling",
    [
        ("pgas_rw alone", torch.float16, PoolingType.SUM),
        ("pgas_rw alone", torch.bfloat16, PoolingType.SUM),
        ("pgas_tw alone", torch.float16, PoolingType.SUM),
        ("pgas_rw alone", torch.float64, PoolingType.MEAN),
        ("pgas_tw+pgas_rw", torch.float16, PoolingType.SUM),
    ],
)
def test_per_sample_weights_of_other_float_dtypes_are_served(mix, dtype, pooling):
    run_ranks(_weights_of_dtype, WORLD, mix=mix, dtype=dtype, pooling=pooling, deadline_s=180)


# ------------------------------------------------------------ plans and set-up


def _row_wise_without_rows(rank, world_size):
    tables = [EmbeddingBagConfig(name="tiny", embedding_dim=4, num_embeddings=1, feature_names=["f0"])]
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"pgas_row_wise: ranks \[1\] get no rows of any table: .*tables \['tiny'\]"):
        shard(ref, {"tiny": pgas_rw()}, world_size, PgasEmbeddingBagCollectionSharder())


def test_row_wise_leaving_a_rank_without_rows_is_refused_on_every_rank():
    run_ranks(_row_wise_without_rows, WORLD, deadline_s=120)


def _bad_first_batch_on_rank_1(rank, world_size, case):
    """A refused first batch must not fix the feature order of the batches after it
    on its rank (TorchRec's input dist keeps the order of the first batch it takes)."""
    mix = "pgas_tw+pgas_rw"
    tables, ref, model = _model(mix)
    keys = ("f2", "f0", "f1")  # not the shardings' order: f0, f2 (pgas_tw), f1 (pgas_rw)
    make_bad, message = BAD[case]
    with pytest.raises(PgasInputError, match=message):
        model(make_bad() if rank == 1 else _good(tables, 4, seed=10, keys=keys))
    for step in range(2):
        _check(model, tables, ref, _good(tables, 2 + rank + step, seed=20 + 2 * step + rank, keys=keys), mix)


@pytest.mark.parametrize("case", ["negative length -1", "duplicate key", "missing key"])
def test_a_bad_first_batch_on_one_rank_leaves_the_module_serving(case):
    run_ranks(_bad_first_batch_on_rank_1, WORLD, case=case, deadline_s=180)


def _small_first_batch(rank, world_size, mix, first):
    """A first batch that is empty on every rank, or of one sample and refused (an id
    out of range on rank 1), does not size the buffers at one sample and one id for
    good: a batch of 100 samples follows, with the default headroom."""
    tables, ref, model = _model(mix)
    if first == "empty":
        empty = KeyedJaggedTensor(
            keys=["f0", "f1", "f2"],
            values=torch.empty(0, dtype=torch.int64),
            lengths=torch.zeros(0, dtype=torch.int64),
            stride=0,
        )
        model(empty)
    else:
        out_of_range = tables[0].num_embeddings if rank == 1 else 0
        tiny = KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.tensor([out_of_range, 0, 0]), lengths=torch.tensor([1, 1, 1])
        )
        with pytest.raises(PgasInputError, match="rank 1 sent id"):
            model(tiny)
    _check(model, tables, ref, _good(tables, 100 + rank, seed=rank), mix)


@pytest.mark.parametrize("first", ["empty", "refused"])
@pytest.mark.parametrize("mix", ["pgas_tw alone", "pgas_tw+pgas_rw"])
def test_a_small_first_batch_does_not_size_capacity_for_good(mix, first):
    run_ranks(_small_first_batch, WORLD, mix=mix, first=first, deadline_s=120)


def _options_differ(rank, world_size, mix):
    options = PgasOptions(timeout_s=30, headroom=2.0 if rank == 0 else 3.0)
    with pytest.raises(ValueError, match=r"PgasOptions differ across ranks in headroom \(rank 0: 2.0, rank 1: 3.0\)"):
        _model(mix, options=options)


@pytest.mark.parametrize("mix", ["pgas_tw alone", "pgas_rw+table_wise"])
def test_different_options_on_different_ranks_are_named(mix):
    run_ranks(_options_differ, WORLD, mix=mix, deadline_s=120)


def _failed_set_up(rank, world_size, mix):
    """Buffers that cannot be set up (here: the pooled rows' mailbox) fail the first
    batch, and every later one with the same error, not an AssertionError."""
    import torchrec_pgas.sharding.tw_exchange as tw_exchange

    real = tw_exchange.Mailbox

    def mailbox(transport, nbytes, per_source, name):
        if name.endswith("pooled rows"):
            raise RuntimeError("cannot map the pooled rows")
        return real(transport, nbytes, per_source, name)

    tw_exchange.Mailbox = mailbox
    tables, ref, model = _model(mix)
    for _ in range(2):
        with pytest.raises(Exception, match="cannot map the pooled rows") as info:
            model(_good(tables, 3, seed=rank)).to_dict()
        assert not isinstance(info.value, AssertionError)


@pytest.mark.parametrize("mix", ["pgas_tw alone", "pgas_tw+pgas_rw"])
def test_a_failed_set_up_raises_its_error_again(mix):
    run_ranks(_failed_set_up, WORLD, mix=mix, deadline_s=120)
