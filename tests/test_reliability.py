"""Reliability of pgas_table_wise on the host transport: random batches against the
float64 oracle (hypothesis), bad dtypes, a rank that dies mid-step, and no leaked
mappings when sharded models come and go."""

import functools
import gc
import os
import queue
import socket
import sys
import time
import traceback
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import (
    assert_close_to_reference,
    pgas_tw,
    reference_pooled,
    run_ranks,
    shard,
    torchrec_tw,
    tw_placement,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_configs import DataType

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding.tw_base import PgasInputError
from torchrec_pgas.sharding_plan import pgas_row_wise, pgas_table_wise
from torchrec_pgas.transport import PgasTimeoutError, PgasTransportUnavailableError, get_transport
from torchrec_pgas.types import PgasOptions

WORLD = 2


# --------------------------------------------------------------- properties


@st.composite
def cases(draw):
    """A plan (tables of one to three features, a feature that two tables pool, each
    table ``pgas_table_wise`` on an owner or ``pgas_row_wise``, weighting) and one batch
    per rank with its features in a random order, empty bags
    and ids at the table bounds."""
    n = draw(st.integers(1, 4))
    tables = [
        dict(
            rows=draw(st.integers(1, 30)),
            dim=4 * draw(st.integers(1, 4)),
            mean=draw(st.booleans()),
            owner=draw(st.integers(0, WORLD - 1)),
            features=[f"f{i}_{j}" for j in range(draw(st.integers(1, 2)))],
        )
        for i in range(n)
    ]
    for t in tables:  # pgas_row_wise beside pgas_table_wise, every rank with rows
        t["row_wise"] = t["rows"] >= WORLD and draw(st.booleans())
    if n >= 2 and draw(st.booleans()):
        for t in draw(st.lists(st.sampled_from(tables), min_size=2, max_size=2, unique_by=id)):
            t["features"].append("shared")
    rows = {}  # a feature's ids must be rows of every table that pools it
    for t in tables:
        for f in t["features"]:
            rows[f] = min(rows.get(f, t["rows"]), t["rows"])
    keys = draw(st.permutations(sorted(rows)))
    weighted = draw(st.booleans())
    batches = []
    for _ in range(WORLD):
        b = draw(st.integers(1, 5))
        bags = []
        for f in keys:
            for _ in range(b):
                r = rows[f]
                ids = draw(st.lists(st.sampled_from([0, r - 1, r // 2]) | st.integers(0, r - 1), max_size=4))
                bags.append(ids)
        batches.append((b, bags))
    return dict(tables=tables, keys=keys, weighted=weighted, batches=batches, seed=draw(st.integers(0, 2**16)))


def _run_case(rank, case):
    specs = case["tables"]
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=t["dim"],
            num_embeddings=t["rows"],
            feature_names=t["features"],
            pooling=PoolingType.MEAN if t["mean"] else PoolingType.SUM,
        )
        for i, t in enumerate(specs)
    ]
    torch.manual_seed(case["seed"])
    ref = EmbeddingBagCollection(tables=tables, is_weighted=case["weighted"], device=torch.device("cpu"))
    placement = {
        t.name: pgas_row_wise(compute_kernel="fused") if spec["row_wise"] else pgas_tw(spec["owner"])
        for t, spec in zip(tables, specs)
    }
    model = shard(ref, placement, WORLD, PgasEmbeddingBagCollectionSharder())
    batch, bags = case["batches"][rank]
    values = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
    g = torch.Generator().manual_seed(case["seed"] + rank)
    kjt = KeyedJaggedTensor(
        keys=list(case["keys"]),
        values=values,
        lengths=torch.tensor([len(bag) for bag in bags], dtype=torch.int64),
        weights=torch.rand(values.numel(), generator=g) if case["weighted"] else None,
    )
    row_wise = [t.name for t, spec in zip(tables, specs) if spec["row_wise"]]
    assert_close_to_reference(model(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt, row_wise))


def _serve(rank, port, inbox, outbox):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    while (case := inbox.get()) is not None:
        try:
            result = (_run_bad_case if "bad" in case else _run_case)(rank, case)
            outbox.put((rank, None, result))
        except Exception:
            outbox.put((rank, traceback.format_exc(), None))
    dist.barrier()
    os._exit(0)  # as dist_utils: no teardown race between the ranks' gloo groups


class _RankPool:
    """WORLD long-lived ranks of one gloo group that run one case at a time: a
    process group per example would cost seconds each."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.inboxes = [ctx.Queue() for _ in range(WORLD)]
        self.outbox = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, port, self.inboxes[r], self.outbox), daemon=True) for r in range(WORLD)
        ]
        for p in self.procs:
            p.start()

    def run(self, case) -> list:
        """Runs ``case`` on every rank; returns what each rank's run returned."""
        for box in self.inboxes:
            box.put(case)
        errors, results = [], [None] * WORLD
        for _ in range(WORLD):
            try:
                rank, error, results_of_rank = self.outbox.get(timeout=120)
            except queue.Empty:
                raise AssertionError(f"no answer within 120 s for {case}")
            results[rank] = results_of_rank
            if error:
                errors.append(f"rank {rank}:\n{error}")
        assert not errors, f"{case}\n" + "\n".join(errors)
        return results

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=30)


@pytest.fixture(scope="module")
def pool():
    p = _RankPool()
    yield p
    p.close()


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_random_batches_match_the_float64_oracle(pool, case):
    pool.run(case)


# ------------------------------------------- malformed batches, mixed sharding types

#: What a malformed batch can be; each is refused on every rank.
MALFORMED = [
    "negative length",
    "float ids",
    "2-D values",
    "missing key",
    "duplicate key",
    "weights not one per id",
    "int weights",
]


@st.composite
def bad_cases(draw):
    """Tables each ``pgas_table_wise``, ``pgas_row_wise`` or TorchRec's ``table_wise``
    in one module, a good batch per rank, then a malformed one on a random rank (the
    others good), then a good one per rank."""
    n = draw(st.integers(2, 4))
    tables = [
        dict(
            rows=draw(st.integers(WORLD, 30)),
            dim=4 * draw(st.integers(1, 3)),
            owner=draw(st.integers(0, WORLD - 1)),
            kind=draw(st.sampled_from(["pgas_tw", "pgas_rw", "table_wise"])),
        )
        for _ in range(n)
    ]
    if all(t["kind"] == "table_wise" for t in tables):
        tables[0]["kind"] = "pgas_tw"
    return dict(
        tables=tables,
        bad=draw(st.sampled_from(MALFORMED)),
        bad_rank=draw(st.integers(0, WORLD - 1)),
        weighted=draw(st.booleans()),
        batch_sizes=[draw(st.integers(1, 5)) for _ in range(3 * WORLD)],
        seed=draw(st.integers(0, 2**16)),
    )


def _malformed(kjt, what):
    keys, values, lengths, weights = kjt.keys(), kjt.values(), kjt.lengths(), kjt.weights_or_none()
    w = weights if weights is not None else None
    if what == "negative length":  # lengths still add up to the values
        lengths = lengths.clone()
        lengths[0] -= 100000
        lengths[1] += 100000
    elif what == "float ids":
        values = values.float()
    elif what == "2-D values":
        values = values.view(-1, 1)
    elif what == "missing key":
        b = kjt.stride()
        n = int(lengths[b:].sum())
        keys, values, lengths = keys[1:], values[values.numel() - n :], lengths[b:]
        w = w[w.numel() - n :] if w is not None else None
    elif what == "duplicate key":
        keys = keys[:-1] + keys[:1]
    elif what == "weights not one per id":
        w = torch.rand(values.numel() + 1)
    elif what == "int weights":
        w = torch.ones(values.numel(), dtype=torch.int64)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=w)


def _run_bad_case(rank, case):
    """Returns this rank's error message for the malformed step."""
    from dist_utils import random_kjt

    specs = case["tables"]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=t["dim"], num_embeddings=t["rows"], feature_names=[f"f{i}"])
        for i, t in enumerate(specs)
    ]
    torch.manual_seed(case["seed"])
    ref = EmbeddingBagCollection(tables=tables, is_weighted=case["weighted"], device=torch.device("cpu"))
    gens = {"pgas_rw": lambda o: pgas_row_wise(compute_kernel="fused"), "pgas_tw": pgas_tw, "table_wise": torchrec_tw}
    placement = {t.name: gens[spec["kind"]](spec["owner"]) for t, spec in zip(tables, specs)}
    # Headroom for a first batch of one sample and later ones of five.
    options = PgasOptions(timeout_s=30, headroom=25.0)
    model = shard(ref, placement, WORLD, PgasEmbeddingBagCollectionSharder(options=options))
    row_wise = [t.name for t, spec in zip(tables, specs) if spec["kind"] == "pgas_rw"]
    sizes = case["batch_sizes"]

    def good(step):
        return random_kjt(
            tables, sizes[step * WORLD + rank], seed=case["seed"] + 7 * step + rank, weighted=case["weighted"]
        )

    def check(kjt):
        assert_close_to_reference(model(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt, row_wise))

    check(good(0))
    kjt = _malformed(good(1), case["bad"]) if rank == case["bad_rank"] else good(1)
    with pytest.raises(PgasInputError, match=f"rank {case['bad_rank']} ") as info:
        model(kjt).to_dict()
    check(good(2))
    return str(info.value)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=bad_cases())
def test_malformed_batches_on_a_random_rank_raise_the_same_error_everywhere(pool, case):
    messages = pool.run(case)
    assert len(set(messages)) == 1, messages


# ------------------------------------------------------------ bad dtypes


def _bad_dtypes(rank, world_size, owners):
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"])
        for i in range(len(owners))
    ]
    keys = [f"f{i}" for i in range(len(owners))]
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=True, device=torch.device("cpu"))
    model = shard(ref, tw_placement(tables, owners, pgas_tw), world_size, PgasEmbeddingBagCollectionSharder())
    n = 3 * len(keys)
    lengths = torch.tensor([2, 1] * len(keys))
    good = KeyedJaggedTensor(keys=keys, values=torch.arange(n) % 10, lengths=lengths, weights=torch.rand(n))
    model(good).to_dict()
    bad = {
        "ids that are not integers": dict(values=torch.arange(n).float(), weights=good.weights()),
        "weights that are not floating point": dict(values=good.values(), weights=torch.arange(n)),
    }
    for what, data in bad.items():
        batch = KeyedJaggedTensor(keys=keys, lengths=lengths, **data) if rank == 0 else good
        with pytest.raises(PgasInputError, match=f"rank 0 sent a KJT with {what}"):
            model(batch)
        expected = reference_pooled(tables, ref.state_dict(), good)
        assert_close_to_reference(model(good).to_dict(), expected)


@pytest.mark.parametrize("owners", [[1], [1, 0, 1]], ids=["in-order", "permuted"])
def test_ids_or_weights_of_a_wrong_dtype_raise_on_every_rank(owners):
    run_ranks(_bad_dtypes, WORLD, owners=owners)


# ------------------------------------------------------------ strided inputs


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a view with stride 2 (a column of a wider tensor)."""
    wide = torch.zeros(t.numel(), 2, dtype=t.dtype)
    wide[:, 0] = t
    return wide[:, 0]


def _strided_values(rank, world_size, placement, strided_ranks):
    """KJTs whose values and weights are strided views, sending one owner exactly one
    id: served as their dense copies are, on every rank, then the next batch too."""
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"]) for i in range(2)
    ]
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=True, device=torch.device("cpu"))
    gen = pgas_tw if placement == "table_wise" else pgas_row_wise
    owners = [0, 1] if placement == "table_wise" else [None, None]
    model = shard(
        ref,
        {t.name: (gen(o) if o is not None else gen()) for t, o in zip(tables, owners)},
        world_size,
        PgasEmbeddingBagCollectionSharder(),
    )
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(3):
        lengths = torch.tensor([1, 0, 2, 1]) if step < 2 else torch.tensor([0, 1, 1, 2])
        values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
        weights = torch.rand(values.numel(), generator=g)
        dense = KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths, weights=weights)
        batch = dense
        if rank in strided_ranks and step < 2:
            batch = KeyedJaggedTensor(
                keys=["f0", "f1"], values=_strided(values), lengths=lengths, weights=_strided(weights)
            )
        expected = reference_pooled(tables, ref.state_dict(), dense)
        assert_close_to_reference(model(batch).to_dict(), expected)


@pytest.mark.parametrize("placement", ["table_wise", "row_wise"])
@pytest.mark.parametrize("strided_ranks", [(1,), (0, 1)], ids=["one-rank", "every-rank"])
def test_strided_values_and_weights_are_served(placement, strided_ranks):
    run_ranks(_strided_values, WORLD, placement=placement, strided_ranks=strided_ranks)


# ---------------------------------------------------------- unknown features


def _unknown_feature(rank, world_size, owners):
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"])
        for i in range(len(owners))
    ]
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    model = shard(ref, tw_placement(tables, owners, pgas_tw), world_size, PgasEmbeddingBagCollectionSharder())
    keys = [f"f{i}" for i in range(len(owners))]
    good = KeyedJaggedTensor(
        keys=keys, values=torch.arange(2 * len(keys)) % 10, lengths=torch.full((2 * len(keys),), 1)
    )
    model(good).to_dict()
    # Rank 1 renames its last feature: the plan does not know it.
    odd = keys[:-1] + ["f_unknown"] if rank == 1 else keys
    bad = KeyedJaggedTensor(keys=odd, values=good.values(), lengths=good.lengths())
    with pytest.raises(
        PgasInputError,
        match=r"rank 1 sent a KJT whose features are not the model's \(they differ where the plan has 'f\d'; 3 features sent, 3 expected",
    ):
        model(bad)
    assert_close_to_reference(model(good).to_dict(), reference_pooled(tables, ref.state_dict(), good))
    # Rank 1 adds a feature after the plan's: the message names where and what the plan has.
    extra = keys + ["f_extra"] if rank == 1 else keys
    values = torch.arange(2 * len(extra)) % 10
    bad = KeyedJaggedTensor(keys=extra, values=values, lengths=torch.full((2 * len(extra),), 1))
    with pytest.raises(
        PgasInputError,
        match=r"they differ after the plan's last, 'f2'; 4 features sent, 3 expected: \['f0', 'f1', 'f2'\]\)",
    ):
        model(bad)
    assert_close_to_reference(model(good).to_dict(), reference_pooled(tables, ref.state_dict(), good))


@pytest.mark.parametrize("owners", [[0, 1, 1], [1, 0, 1]], ids=["in-order", "permuted"])
def test_a_feature_the_plan_does_not_know_raises_on_every_rank(owners):
    run_ranks(_unknown_feature, WORLD, owners=owners)


def _unaligned_dim(rank, world_size, kind):
    # t0's owner (rank 1) is the only rank whose TorchRec lookup would assert.
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=6, num_embeddings=10, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
    ]
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    gen = {"pgas_table_wise": pgas_tw, "table_wise": torchrec_tw}[kind]
    with pytest.raises(ValueError, match=r"table\(s\) \['t0'\] would have shards of \{'t0': \[6\]\} columns"):
        shard(ref, {"t0": gen(1), "t1": pgas_tw(0)}, world_size, PgasEmbeddingBagCollectionSharder())


@pytest.mark.parametrize("kind", ["pgas_table_wise", "table_wise"])
def test_a_dim_not_a_multiple_of_4_is_refused_on_every_rank(kind):
    run_ranks(_unaligned_dim, WORLD, kind=kind)


def _bf16_table(rank, world_size, kind):
    # t0's owner (rank 1) is the only rank whose FBGEMM lookup would raise, at the
    # first forward; a fp16 table beside it is fine.
    tables = [
        EmbeddingBagConfig(
            name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"], data_type=DataType.BF16
        ),
        EmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"], data_type=DataType.FP16
        ),
    ]
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    gen = {"pgas_table_wise": pgas_tw, "pgas_row_wise": lambda _: pgas_row_wise("fused")}[kind]
    with pytest.raises(ValueError, match=r"table\(s\) \['t0'\] are bfloat16 on CPU ranks"):
        shard(ref, {"t0": gen(1), "t1": pgas_tw(0)}, world_size, PgasEmbeddingBagCollectionSharder())


@pytest.mark.parametrize("kind", ["pgas_table_wise", "pgas_row_wise"])
def test_a_bf16_table_on_cpu_is_refused_on_every_rank(kind):
    run_ranks(_bf16_table, WORLD, kind=kind)


#: How rank 1's model differs from rank 0's, and the table description that says so.
MISMATCHES = {
    "rows": ("t0", r"'t0': 31 rows"),
    "dim": ("t1", r"'t1': \d+ rows x 24 "),
    "pooling": ("t2", r"MEAN pooling"),
    "owner": ("t2", r"pgas_table_wise \(fused\) on ranks \[1\]"),
    "torchrec type": ("t2", r"table_wise \(fused\) on ranks \[0\]"),
    "weighted": ("t0", r"SUM pooling, weighted of"),
    "output dtype": ("t0", r"output FP16"),
}


def _mismatched(rank, world_size, what):
    """Rank 1 builds a model that differs from rank 0's in one table (or its plan):
    a row more, another dim or pooling, another owner, TorchRec's type instead of ours;
    per-sample weights in its module only, or another output dtype."""
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=30, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=40, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=20, feature_names=["f2", "f3"]),
    ]
    placement = {"t0": pgas_tw(0), "t1": pgas_row_wise(), "t2": pgas_tw(0)}
    weighted, fused = False, None
    if rank == 1:
        if what == "rows":
            tables[0].num_embeddings += 1
        elif what == "dim":
            tables[1].embedding_dim = 24
        elif what == "pooling":
            tables[2].pooling = PoolingType.MEAN
        elif what == "owner":
            placement["t2"] = pgas_tw(1)
        elif what == "weighted":
            weighted = True
        elif what == "output dtype":
            fused = {"output_dtype": DataType.FP16}
        else:
            placement["t2"] = torchrec_tw(0)
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    table, described = MISMATCHES[what]
    message = rf"the tables differ across ranks \(table #\d: rank 0: '{table}': .*; rank 1: .*{described}.*\): build"
    with pytest.raises(ValueError, match=message):
        shard(ref, placement, world_size, PgasEmbeddingBagCollectionSharder(fused_params=fused))


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_ranks_whose_models_differ_are_refused_on_every_rank(what):
    """Without the check, a requester that sees a larger table than its owner sends ids
    past the owner's rows (the GPU lookup does not check them again; on CPU the owner
    alone raised, its peer hung); other differences mis-sized buffers or hung."""
    run_ranks(_mismatched, WORLD, what=what, deadline_s=120)


def _unaligned_dense(rank, world_size):
    from torchrec.distributed.sharding_plan import data_parallel

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=6, num_embeddings=10, feature_names=[f"f{i}"]) for i in range(3)
    ]
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    dense_tw = functools.partial(pgas_table_wise, compute_kernel="dense")
    placement = {"t0": dense_tw(1), "t1": dense_tw(0), "t2": data_parallel()}
    model = shard(ref, placement, world_size, PgasEmbeddingBagCollectionSharder())
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"], values=torch.tensor([1, 9, 0, 4, 5, 2]), lengths=torch.ones(6, dtype=torch.int64)
    )
    assert_close_to_reference(model(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt))


def test_dims_not_multiples_of_4_are_served_by_the_dense_kernel():
    """FBGEMM's dense kernel (and so data-parallel tables) takes any dim."""
    run_ranks(_unaligned_dense, WORLD)


def _variable_batch(rank, world_size):
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"]) for i in range(2)
    ]
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    model = shard(ref, tw_placement(tables, [0, 1], pgas_tw), world_size, PgasEmbeddingBagCollectionSharder())
    good = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    model(good).to_dict()
    vbe = KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1], [2]],
    )
    with pytest.raises(PgasInputError, match="rank 1 sent a KJT with a variable batch size per feature"):
        model(vbe if rank == 1 else good)
    assert_close_to_reference(model(good).to_dict(), reference_pooled(tables, ref.state_dict(), good))


def test_variable_batch_per_feature_raises_on_every_rank():
    run_ranks(_variable_batch, WORLD)


# ---------------------------------------------------------------- dead rank


def _dead_rank(rank, world_size, when):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_pgas.sharding.tw_exchange import TwExchange

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"]) for i in range(2)
    ]
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1},
        options=PgasOptions(timeout_s=3),
    )
    model = shard(ref, tw_placement(tables, [0, 1], pgas_tw), world_size, sharder)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    model(kjt).values().sum().backward()
    if rank == 1:
        # dies as a crashed trainer would: between two steps, after sending its ids but
        # before its rows, or in the backward before its gradients
        if when == "between steps":
            os._exit(0)
        if when == "in forward":
            TwExchange.exchange_pooled = lambda *args: os._exit(0)
    timed_out = pytest.raises(PgasTimeoutError, match=r"rank 0: timed out after 3.0 s waiting for .* from rank 1")
    if when == "in backward":
        out = model(kjt).values()  # the forward is whole on both ranks
        if rank == 1:
            out.register_hook(lambda grad: os._exit(0))
        with timed_out:
            out.sum().backward()
    else:
        with timed_out:
            model(kjt)
    os._exit(0)  # the group is broken: no barrier, no teardown


@pytest.mark.parametrize("when", ["between steps", "in forward", "in backward"])
def test_a_dead_rank_makes_its_peers_raise_within_the_timeout(when):
    run_ranks(_dead_rank, WORLD, when=when)


# --------------------------------------------------------------------- leaks


def _mapped_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum("torchrec_pgas." in line for line in f)


def _churn(rank, world_size):
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20, feature_names=[f"f{i}"]) for i in range(2)
    ]
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    counts = []
    for _ in range(8):
        ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        model = shard(ref, tw_placement(tables, [0, 1], pgas_tw), world_size, PgasEmbeddingBagCollectionSharder())
        model(kjt).to_dict()
        del model, ref
        gc.collect()
        counts.append(_mapped_segments())
    assert counts[-1] == counts[1], f"mappings grow as models come and go: {counts}"


def test_models_that_come_and_go_leak_no_mappings():
    run_ranks(_churn, WORLD)


# ------------------------------------------------------------------ long run


def _long_run(rank, world_size, steps, check_every):
    from dist_utils import make_tables, random_kjt
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_pgas.testing import gather_unsharded_state_dict

    tables = make_tables(4, seed=21)
    torch.manual_seed(21)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-3}
    sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused)
    owners = [0, 1, 1, 0]
    pgas = shard(ref, tw_placement(tables, owners, pgas_tw), world_size, sharder)
    tw = shard(ref, tw_placement(tables, owners, torchrec_tw), world_size, sharder)
    like = ref.state_dict()
    for step in range(1, steps + 1):
        kjt = random_kjt(tables, 3 + (step + rank) % 4, seed=step * 10 + rank)
        for model in (pgas, tw):
            kt = model(kjt).to_dict()
            sum(v.square().sum() for v in kt.values()).backward()
        if step % check_every == 0:
            a = gather_unsharded_state_dict(pgas, like, prefix="ebc.")
            b = gather_unsharded_state_dict(tw, like, prefix="ebc.")
            for name in b:
                assert torch.equal(a[name], b[name]), f"step {step}: {name} differs from table_wise"


def test_training_stays_identical_to_table_wise_short_run():
    run_ranks(_long_run, WORLD, steps=300, check_every=100)


@pytest.mark.slow
def test_training_stays_identical_to_table_wise_10k_steps():
    run_ranks(_long_run, WORLD, steps=10_000, check_every=1_000, deadline_s=3600)


def _nvshmem_missing_on_rank_1(rank, world_size):
    if rank == 0:
        # Rank 0 "has" nvshmem4py: without the agreement it would go on to the unique-id
        # broadcast and wait there for rank 1 forever.
        fake = types.ModuleType("nvshmem.core")
        fake.NvshmemKernelObject = object
        sys.modules["nvshmem"] = types.ModuleType("nvshmem")
        sys.modules["nvshmem.core"] = fake
    else:
        sys.modules["nvshmem"] = None  # type: ignore[assignment]
    options = PgasOptions(transport="nvshmem", timeout_s=5)
    with pytest.raises(PgasTransportUnavailableError) as info:
        get_transport(dist.group.WORLD, torch.device("cuda", 0), options)
    message = str(info.value)
    assert "rank 1: NVSHMEM is not available" in message, message
    assert "pip install 'torchrec-pgas[gpu]'" in message, message


def test_a_rank_without_nvshmem_makes_every_rank_raise_with_the_fix():
    run_ranks(_nvshmem_missing_on_rank_1, 2)


def _fake_nvshmem(rank, failure):
    """An nvshmem4py stand-in on CPU tensors that fails on rank 1 as ``failure`` says;
    returns the list its ``init`` and ``finalize`` calls go to."""
    import numpy as np

    import torchrec_pgas.transport.nvshmem as transport

    fake = types.ModuleType("nvshmem.core")
    fake.NvshmemKernelObject = object
    fake.get_unique_id = lambda empty: types.SimpleNamespace(_data=np.zeros(128, dtype=np.int8))

    calls = []

    def init(**kwargs):
        calls.append("init")
        if failure == "init" and rank == 1:
            raise RuntimeError("nvshmemi_bootstrap failed")

    fake.init = init
    fake.finalize = lambda: calls.append("finalize")
    fake.free_tensor = lambda t: calls.append("free")
    fake.tensor = lambda shape, dtype: torch.zeros(shape, dtype=dtype)
    fake.get_peer_tensor = lambda t, pe: None if failure == "peer access" and rank == 1 and pe == 0 else t
    sys.modules["nvshmem"] = types.ModuleType("nvshmem")
    sys.modules["nvshmem.core"] = fake
    transport._cuda_core_device = lambda index: None
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    return calls


def _nvshmem_fails_on_rank_1(rank, world_size, failure):
    _fake_nvshmem(rank, failure)
    options = PgasOptions(transport="nvshmem", timeout_s=5)
    with pytest.raises(PgasTransportUnavailableError) as info:
        get_transport(dist.group.WORLD, torch.device("cuda", 0), options)
    message = str(info.value)
    expected = {
        "init": "rank 1: NVSHMEM initialization failed (nvshmemi_bootstrap failed); install",
        "peer access": "rank 1: no peer (NVLink/P2P) access to ranks [0]",
    }[failure]
    assert expected in message, message
    assert ("NVSHMEM_DEBUG=INFO" if failure == "init" else "nvidia-smi topo -m") in message, message


@pytest.mark.parametrize("failure", ["init", "peer access"])
def test_nvshmem_failing_on_one_rank_makes_every_rank_raise_with_the_fix(failure):
    run_ranks(_nvshmem_fails_on_rank_1, 2, failure=failure)


def _nvshmem_over_a_subgroup(rank, world_size):
    _fake_nvshmem(rank, failure=None)
    options = PgasOptions(transport="nvshmem", timeout_s=5)
    every = dist.new_group([0, 1])  # every process: fine, though not the default group
    assert get_transport(every, torch.device("cuda", 0), options) is not None
    first = dist.new_group([0])
    if rank == 0:
        with pytest.raises(
            PgasTransportUnavailableError,
            match=r"rank 0: the NVSHMEM transport spans every process of the job \(2\), not a group of 1",
        ):
            get_transport(first, torch.device("cuda", 0), options)


def test_nvshmem_over_some_of_the_processes_is_refused_not_left_waiting():
    run_ranks(_nvshmem_over_a_subgroup, 2)


def _nvshmem_started_once(rank, world_size):
    import torchrec_pgas.transport as transports

    calls = _fake_nvshmem(rank, failure=None)
    first, second = (
        get_transport(dist.group.WORLD, torch.device("cuda", 0), PgasOptions(transport="nvshmem", timeout_s=t))
        for t in (5, 7)
    )
    assert first is not second and calls == ["init"]
    transports._close_all()
    assert [c for c in calls if c != "free"] == ["init", "finalize"]


def test_nvshmem_starts_once_per_process_and_ends_with_its_last_transport():
    run_ranks(_nvshmem_started_once, 2)


def _nvshmem_left_as_found(rank, world_size, failure):
    """A transport that fails to start frees what it allocated and finalizes NVSHMEM
    where it started it."""
    import torchrec_pgas.transport.nvshmem as nvshmem_transport

    calls = _fake_nvshmem(rank, failure)
    with pytest.raises(PgasTransportUnavailableError):
        get_transport(dist.group.WORLD, torch.device("cuda", 0), PgasOptions(transport="nvshmem", timeout_s=5))
    started = failure == "peer access" or rank == 0
    expected = ["init"] + (["free"] * 4 if failure == "peer access" else []) + (["finalize"] if started else [])
    assert calls == expected and nvshmem_transport._users == 0, calls


@pytest.mark.parametrize("failure", ["init", "peer access"])
def test_nvshmem_that_fails_to_start_is_left_as_found(failure):
    run_ranks(_nvshmem_left_as_found, 2, failure=failure)


def _fail_while_the_others_wait(rank, world_size):
    if rank == world_size - 1:
        raise ValueError(f"wrong on rank {rank}")
    dist.barrier()  # waits for the failed rank forever


def test_run_ranks_reports_a_failed_rank_at_once_with_its_traceback():
    """The harness itself: a rank that raises while the others wait for it fails the
    test with that rank's traceback, long before the deadline (not as a hang)."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match="wrong on rank 2"):
        run_ranks(_fail_while_the_others_wait, 3, deadline_s=120)
    assert time.monotonic() - start < 60
