"""Modules whose tables are all PGAS types, ``pgas_table_wise`` and ``pgas_row_wise``
mixed: batches go to every sharding as they are (the direct path), with the same
results as TorchRec's permute-and-split path of the same plan (bit for bit), as
TorchRec's ``table_wise`` + ``row_wise`` and as a float64 reference; bad batches raise
the same error on every rank. Real gloo process groups, host transport."""

import functools
from typing import Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
from dist_utils import (
    assert_close_to_reference,
    assert_same_kt,
    in_order,
    make_tables,
    pgas_tw,
    random_kjt,
    reference_pooled,
    run_ranks,
    shard,
    torchrec_tw,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed import embeddingbag
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding.tw_base import PgasInputError
from torchrec_pgas.sharding_plan import pgas_row_wise
from torchrec_pgas.testing import gather_unsharded_state_dict, load_unsharded_state_dict
from torchrec_pgas.types import PgasOptions

pgas_rw = functools.partial(pgas_row_wise, compute_kernel="fused")
torchrec_rw = functools.partial(row_wise, compute_kernel="fused")

#: Per table: ("tw", owner) or ("rw",). With three ranks, rank 1 owns no table-wise
#: table (only its row blocks).
KINDS = {
    2: [("rw",), ("tw", 1), ("tw", 1), ("rw",), ("tw", 0)],
    3: [("tw", 0), ("rw",), ("tw", 2), ("rw",), ("tw", 0)],
}
BATCH_SIZES = {2: [5, 2], 3: [3, 6, 1]}


def _tables(world_size: int, seed: int, pooling: PoolingType) -> List[EmbeddingBagConfig]:
    """``make_tables`` for ``KINDS[world_size]``, the last table pooling two features."""
    tables = make_tables(len(KINDS[world_size]), seed, pooling)
    last = tables[-1]
    tables[-1] = EmbeddingBagConfig(
        name=last.name,
        embedding_dim=last.embedding_dim,
        num_embeddings=last.num_embeddings,
        feature_names=[last.feature_names[0], "g"],
        pooling=pooling,
    )
    return tables


def _placement(tables, world_size: int, tw: Callable, rw: Callable) -> Dict[str, Callable]:
    return {t.name: tw(k[1]) if k[0] == "tw" else rw() for t, k in zip(tables, KINDS[world_size])}


def _row_wise(world_size: int, tables) -> List[str]:
    return [t.name for t, k in zip(tables, KINDS[world_size]) if k[0] == "rw"]


class _TorchRecInputDists:
    """Counts, per module, the calls of TorchRec's input dist (the permute and split
    the direct path does without) in this process."""

    def __init__(self) -> None:
        self.calls: Dict[int, int] = {}
        original = embeddingbag.ShardedEmbeddingBagCollection.input_dist

        def counting(module, ctx, features):
            self.calls[id(module)] = self.calls.get(id(module), 0) + 1
            return original(module, ctx, features)

        embeddingbag.ShardedEmbeddingBagCollection.input_dist = counting

    def of(self, dmp: nn.Module, name: str = "ebc") -> int:
        return self.calls.get(id(getattr(dmp.module, name)), 0)


def _models(world_size, tables, weighted, seed, fused_params=None):
    """The unsharded module, the PGAS plan on the direct path, the same plan forced
    through TorchRec's path, and TorchRec's table_wise + row_wise."""
    torch.manual_seed(seed)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused_params, options=PgasOptions(timeout_s=30))
    pgas = shard(ref, _placement(tables, world_size, pgas_tw, pgas_rw), world_size, sharder)
    forced = shard(ref, _placement(tables, world_size, pgas_tw, pgas_rw), world_size, sharder)
    forced.module.ebc._pgas_direct = False  # decided before its first batch: TorchRec's path
    torchrec = shard(ref, _placement(tables, world_size, torchrec_tw, torchrec_rw), world_size, sharder)
    return ref, pgas, forced, torchrec


# ------------------------------------------------------------------- forward


def _joined(kt) -> bool:
    """Whether the module's output came out whole, each sharding's columns put in place
    (``dists.joined_output``), not from TorchRec's ``torch.cat`` of their outputs."""
    fn = kt.values().grad_fn
    return fn is not None and "JoinedOutput" in fn.name()


def _forward(rank, world_size, order, pooling, weighted):
    counter = _TorchRecInputDists()
    for seed in range(2):
        tables = _tables(world_size, seed, pooling)
        ref, pgas, forced, torchrec = _models(world_size, tables, weighted, seed)
        keys = [f for t in tables for f in t.feature_names]
        if order == "shuffled":  # the same on every rank
            keys = [keys[i] for i in torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed))]
        for step in range(4):
            # Uneven batch sizes, empty bags; at step 3 rank 0 has no sample at all.
            batch_size = 0 if step == 3 and rank == 0 else BATCH_SIZES[world_size][rank] + step
            kjt = in_order(random_kjt(tables, batch_size, 1000 * seed + 10 * step + rank, weighted), keys)
            with torch.no_grad() if step == 2 else torch.enable_grad():
                out = pgas(kjt)
                assert _joined(out) == (step != 2), (seed, step)
                assert_same_kt(out, forced(kjt), exact=True)
                if pooling == PoolingType.SUM:
                    # TorchRec's row_wise mean divides every column of a module that has
                    # it; the reference below is the oracle of mean pooling.
                    assert_same_kt(out, torchrec(kjt), exact=False)
                if batch_size:
                    expected = reference_pooled(tables, ref.state_dict(), kjt, _row_wise(world_size, tables))
                    assert_close_to_reference(out.to_dict(), expected)
        # TorchRec's pipelines call the input dist and the rest apart: the same outputs.
        kjt = in_order(random_kjt(tables, 3 + rank, 77 + rank, weighted), keys)
        ebc = pgas.module.ebc
        ctx = ebc.create_context()
        piped = ebc.compute_and_output_dist(ctx, ebc.input_dist(ctx, kjt).wait().wait()).wait()
        assert_same_kt(piped, forced(kjt), exact=True)
        assert _joined(piped), "the pipelines' way in joins the output in place too"
        assert ebc._pgas_direct is True and len(ebc._embedding_shardings) == 2
        assert counter.of(pgas) == 0, "the direct path took TorchRec's input dist"
        assert counter.of(forced) == 5  # ... which this count would have shown


def _half_outputs(rank, world_size):
    tables = _tables(world_size, 3, PoolingType.MEAN)
    ref, pgas, forced, torchrec = _models(world_size, tables, False, 3, fused_params={"output_dtype": SparseType.FP16})
    keys = [f for t in tables for f in t.feature_names]
    for step in range(3):
        kjt = in_order(random_kjt(tables, BATCH_SIZES[world_size][rank] + step, 10 * step + rank), keys)
        with torch.no_grad() if step == 2 else torch.enable_grad():
            out, theirs = pgas(kjt), torchrec(kjt)
            assert not _joined(out), "fp16 outputs divided in float32 are concatenated"
            assert out.values().dtype == theirs.values().dtype == torch.float32
            assert_same_kt(out, forced(kjt), exact=True)


def test_half_outputs_with_row_wise_mean_keep_torchrec_dtype():
    """fp16 outputs of a module with mean-pooled ``pgas_row_wise`` tables: the division
    by float32 divisors promotes that sharding's output, and TorchRec's ``torch.cat``
    the module's (as TorchRec's own mean does), so the output is not joined in place."""
    run_ranks(_half_outputs, 2, deadline_s=300)


def test_an_output_destination_that_is_not_the_output_is_refused():
    """A step's ``dest`` must be the sharding's output exactly (its rows and columns, its
    dtype, contiguous elements): anything else is refused, naming the sharding."""
    from torchrec_pgas.sharding.exchange import check_dest

    for good in (torch.zeros(3, 4), torch.zeros(3, 12)[:, 4:8], torch.zeros(0, 4)):
        check_dest(good, (good.shape[0], 4), torch.float32, "s")
    for bad in (torch.zeros(3, 5), torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.float16), torch.zeros(4, 3).t()):
        with pytest.raises(ValueError, match="s: the step's output destination"):
            check_dest(bad, (3, 4), torch.float32, "s")


@pytest.mark.parametrize(
    "world_size,order,pooling,weighted",
    [
        (2, "module", PoolingType.SUM, False),
        (2, "shuffled", PoolingType.MEAN, True),
        (3, "shuffled", PoolingType.SUM, True),
        (3, "module", PoolingType.MEAN, False),
    ],
)
def test_table_wise_and_row_wise_in_one_module_take_the_direct_path(world_size, order, pooling, weighted):
    run_ranks(_forward, world_size, order=order, pooling=pooling, weighted=weighted, deadline_s=300)


# ------------------------------------------------------------------ training


def _train(rank, world_size, optimizer, pooling):
    fused = {"optimizer": optimizer, "learning_rate": 0.1, "eps": 1e-3}
    tables = _tables(world_size, 7, pooling)
    ref, pgas, forced, torchrec = _models(world_size, tables, False, 7, fused_params=fused)
    # TorchRec's row_wise mean divides every column of a module that has it: with mean
    # pooling the oracle is the same plan on TorchRec's path (``forced``), bit for bit.
    models = (pgas, forced, torchrec) if pooling == PoolingType.SUM else (pgas, forced)
    keys = list(reversed([f for t in tables for f in t.feature_names]))
    for step in range(4):
        # One batch size on every rank: TorchRec's row_wise backward on gloo takes no other.
        kjt = in_order(random_kjt(tables, 3 + step, 100 * step + rank), keys)
        outs = []
        for model in models:
            g = torch.Generator().manual_seed(step)
            kt = model(kjt)
            assert _joined(kt) == (model is pgas)
            kt = kt.to_dict()
            sum((kt[k] * torch.randn(kt[k].shape, generator=g)).sum() for k in sorted(kt)).backward()
            outs.append({k: v.detach() for k, v in kt.items()})
        for k in outs[0]:
            assert torch.equal(outs[0][k], outs[1][k]), (step, k)
            if len(outs) > 2:
                torch.testing.assert_close(outs[0][k], outs[2][k], rtol=1e-5, atol=1e-6)
    like = ref.state_dict()
    trained = [gather_unsharded_state_dict(m, like, prefix="ebc.") for m in models]
    for name in like:
        assert torch.equal(trained[0][name], trained[1][name]), name
        if len(trained) > 2:
            torch.testing.assert_close(trained[0][name], trained[2][name], rtol=0, atol=1e-6)
        assert not torch.equal(trained[0][name], like[name]), f"{name} was not trained"
    assert pgas.module.ebc._pgas_direct is True


@pytest.mark.parametrize(
    "world_size,optimizer,pooling",
    [
        (2, EmbOptimType.EXACT_SGD, PoolingType.SUM),
        (3, EmbOptimType.EXACT_SGD, PoolingType.SUM),
        (2, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingType.SUM),
        (3, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingType.SUM),
        (2, EmbOptimType.EXACT_SGD, PoolingType.MEAN),
        (3, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingType.MEAN),
    ],
)
def test_training_matches_table_wise_and_row_wise(world_size, optimizer, pooling):
    """Training through the module's joined output against TorchRec's path of the same
    plan (outputs and weights bit for bit; with mean pooling, the gradient divided as
    the output was) and TorchRec's own types (sum pooling)."""
    run_ranks(_train, world_size, optimizer=optimizer, pooling=pooling, deadline_s=300)


class _TrainStep(nn.Module):
    """What TrainPipelineSparseDist runs: a batch's (loss, output); the batch's dense
    features weigh the pooled columns."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        return (pooled * batch.dense_features).sum(), pooled


def _pipeline(rank, world_size):
    """TorchRec's training pipeline calls the input dist apart from the rest (on the
    batch ahead): the same updates as direct calls of the module, and no TorchRec
    input dist."""
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    counter = _TorchRecInputDists()
    tables = _tables(world_size, 4, PoolingType.SUM)
    torch.manual_seed(4)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}
    sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused, options=PgasOptions(timeout_s=30))
    placement = _placement(tables, world_size, pgas_tw, pgas_rw)
    piped = shard(ref, placement, world_size, sharder, wrapper=_TrainStep)
    direct = shard(ref, placement, world_size, sharder, wrapper=_TrainStep)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    keys = list(reversed([f for t in tables for f in t.feature_names]))
    batches = []
    for i in range(5):
        kjt = in_order(random_kjt(tables, 3 + i % 2, 10 * i + rank), keys)
        dense = torch.randn(kjt.stride(), width, generator=torch.Generator().manual_seed(i + 100 * rank))
        batches.append(Batch(dense_features=dense, sparse_features=kjt, labels=torch.zeros(kjt.stride())))
    pipeline = TrainPipelineSparseDist(piped, piped.fused_optimizer, torch.device("cpu"))
    it = iter(batches)
    outs = []
    with pytest.raises(StopIteration):
        while True:
            outs.append(pipeline.progress(it).detach())  # the model's output
    for batch, out in zip(batches, outs):
        loss, expected = direct(batch)
        loss.backward()
        assert torch.equal(out, expected.detach())
    like = ref.state_dict()
    trained = [gather_unsharded_state_dict(m, like, prefix="ebc.") for m in (piped, direct)]
    for name in like:
        assert torch.equal(trained[0][name], trained[1][name]), name
        assert not torch.equal(trained[0][name], like[name]), f"{name} was not trained"
    assert piped.module.ebc._pgas_direct is True and counter.of(piped) == 0


def test_training_pipeline_takes_the_direct_input_dist():
    run_ranks(_pipeline, 2, deadline_s=300)


# ------------------------------------------------------- several modules


class _TwoModules(nn.Module):
    def __init__(self, a: EmbeddingBagCollection, b: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc, self.ebc2 = a, b

    def forward(self, kjt: KeyedJaggedTensor, kjt2: KeyedJaggedTensor):
        return self.ebc(kjt), self.ebc2(kjt2)


def _two_module_model(refs, placements, world_size, sharder):
    plans = {
        name: construct_module_sharding_plan(
            ref, per_param_sharding=placement, world_size=world_size, device_type="cpu", sharder=sharder
        )
        for name, ref, placement in zip(["ebc", "ebc2"], refs, placements)
    }
    dmp = DistributedModelParallel(
        _TwoModules(
            *[EmbeddingBagCollection(tables=r.embedding_bag_configs(), device=torch.device("meta")) for r in refs]
        ),
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan(plans),
        sharders=[sharder],
        init_data_parallel=False,
    )
    for name, ref in zip(["ebc", "ebc2"], refs):
        load_unsharded_state_dict(dmp, ref.state_dict(), prefix=f"{name}.")
    return dmp


def _several_modules(rank, world_size):
    counter = _TorchRecInputDists()
    tables = _tables(world_size, 3, PoolingType.SUM)
    tables2 = [
        EmbeddingBagConfig(name=f"u{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"h{i}"])
        for i, n in enumerate([13, 6, 21])
    ]
    kinds2 = [("rw",), ("tw", world_size - 1), ("tw", 0)]
    torch.manual_seed(3)
    refs = [EmbeddingBagCollection(tables=t, device=torch.device("cpu")) for t in (tables, tables2)]
    sharder = PgasEmbeddingBagCollectionSharder(options=PgasOptions(timeout_s=30))

    def placements(tw, rw):
        second = {t.name: tw(k[1]) if k[0] == "tw" else rw() for t, k in zip(tables2, kinds2)}
        return [_placement(tables, world_size, tw, rw), second]

    pgas = _two_module_model(refs, placements(pgas_tw, pgas_rw), world_size, sharder)
    torchrec = _two_module_model(refs, placements(torchrec_tw, torchrec_rw), world_size, sharder)
    keys2 = ["h2", "h0", "h1"]
    for step in range(3):
        kjt = random_kjt(tables, BATCH_SIZES[world_size][rank] + step, 10 * step + rank)
        kjt2 = in_order(random_kjt(tables2, 2 + rank + step, 500 + 10 * step + rank), keys2)
        out, out2 = pgas(kjt, kjt2)
        expected, expected2 = torchrec(kjt, kjt2)
        assert_same_kt(out, expected, exact=False)
        assert_same_kt(out2, expected2, exact=False)
        assert_close_to_reference(
            out.to_dict(), reference_pooled(tables, refs[0].state_dict(), kjt, _row_wise(world_size, tables))
        )
        assert_close_to_reference(out2.to_dict(), reference_pooled(tables2, refs[1].state_dict(), kjt2))
    for name in ("ebc", "ebc2"):
        assert getattr(pgas.module, name)._pgas_direct is True
        assert counter.of(pgas, name) == 0
        assert counter.of(torchrec, name) == 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_several_such_modules_in_one_model(world_size):
    run_ranks(_several_modules, world_size, deadline_s=300)


# ------------------------------------------------------------- bad batches


def _out_of_range(tables, feature):
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}

    def bad(kjt):
        values = kjt.values().clone()
        first = kjt.offsets()[kjt.keys().index(feature) * kjt.stride()]
        values[first] = rows[feature]
        return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(), weights=kjt.weights_or_none())

    return bad


def _negative_length(kjt):
    lengths = kjt.lengths().clone()  # the same sum: only the sign gives it away
    lengths[1] += lengths[0] + 1
    lengths[0] = -1
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=lengths, weights=kjt.weights_or_none())


def _missing_key(kjt):
    keep = kjt.keys()[:-1]
    return in_order(kjt, keep)


def _torn_weights(kjt):
    return KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=torch.rand(kjt.values().numel() + 1)
    )


#: What rank 1 does to its batch, and what every rank's error says.
BAD = {
    # f0 is row-wise, f2 table-wise (KINDS[2]): found whichever sharding is received first.
    "id out of range (row-wise)": (
        lambda t: _out_of_range(t, "f0"),
        r"rank 1 sent id \d+ for feature 'f0' of table 't0'",
    ),
    "id out of range (table-wise)": (
        lambda t: _out_of_range(t, "f2"),
        r"rank 1 sent id \d+ for feature 'f2' of table 't2'",
    ),
    "negative length": (lambda t: _negative_length, r"rank 1 .*negative"),
    "missing key": (lambda t: _missing_key, r"rank 1 sent a KJT whose features are not the model's"),
    "torn weights": (lambda t: _torn_weights, r"rank 1 sent a KJT whose weights and values disagree"),
}


def _bad_batch(rank, world_size, case):
    tables = _tables(world_size, 5, PoolingType.MEAN)
    ref, pgas, forced, _ = _models(world_size, tables, True, 5)
    keys = list(reversed([f for t in tables for f in t.feature_names]))

    def batch(seed, batch_size=3):
        return in_order(random_kjt(tables, batch_size, seed, weighted=True), keys)

    make_bad, message = BAD[case]
    spoil = make_bad(tables)
    for step in range(2):
        good = batch(10 * step + rank)
        for model in (pgas, forced):
            model(good)  # the first batch decides the path: a good one
        bad = batch(100 + 10 * step + rank, 4)
        if rank == 1:  # an id in every feature's first bag: each case has one to spoil
            bad = _nonempty_first_bags(bad)
        errors = []
        for model in (pgas, forced) if case != "missing key" else (pgas,):
            with pytest.raises(PgasInputError, match=message) as info:
                model(spoil(bad) if rank == 1 else bad)
            errors.append(str(info.value))
        everyone = [None] * world_size
        dist.all_gather_object(everyone, errors[0])
        assert everyone == [errors[0]] * world_size, everyone
        # The next batch is this step's on every rank, and right.
        nxt = batch(200 + 10 * step + rank, 2 + rank)
        out = pgas(nxt)
        assert_same_kt(out, forced(nxt), exact=True)
        expected = reference_pooled(tables, ref.state_dict(), nxt, _row_wise(world_size, tables))
        assert_close_to_reference(out.to_dict(), expected)
    assert pgas.module.ebc._pgas_direct is True


def _nonempty_first_bags(kjt):
    """``kjt`` with one more id (0) at the start of every feature's first bag."""
    keys, batch = kjt.keys(), kjt.stride()
    lengths = kjt.lengths().clone().view(len(keys), batch)
    per_feature = kjt.values().split(lengths.sum(1).tolist())
    weights = kjt.weights().split(lengths.sum(1).tolist())
    lengths[:, 0] += 1
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([torch.cat([torch.zeros(1, dtype=v.dtype), v]) for v in per_feature]),
        lengths=lengths.view(-1),
        weights=torch.cat([torch.cat([torch.ones(1), w]) for w in weights]),
    )


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_batch_on_one_rank_raises_the_same_error_everywhere(case):
    run_ranks(_bad_batch, 2, case=case, deadline_s=300)


def _second_send_fails(rank, world_size):
    """An error preparing the send of the second sharding only, on rank 1: the first
    sharding's step is served and the second's raises, on every rank alike, and the
    next batch is right."""
    tables = _tables(world_size, 2, PoolingType.SUM)
    ref, pgas, _, torchrec = _models(world_size, tables, False, 2)
    keys = list(reversed([f for t in tables for f in t.feature_names]))

    def check(step):
        kjt = in_order(random_kjt(tables, 2 + rank + step, 10 * step + rank), keys)
        out = pgas(kjt)
        assert_same_kt(out, torchrec(kjt), exact=False)
        assert_close_to_reference(out.to_dict(), reference_pooled(tables, ref.state_dict(), kjt))

    check(0)
    second = pgas.module.ebc._pgas_exchanges[1]
    if rank == 1:
        original = second._check

        def failing(*args):
            second._check = original
            raise RuntimeError("injected failure")

        second._check = failing
    with pytest.raises(PgasInputError, match=r"rank 1 could not send its batch: RuntimeError: injected failure"):
        pgas(in_order(random_kjt(tables, 3, 50 + rank), keys))
    for step in range(1, 3):
        check(step)
    assert pgas.module.ebc._pgas_direct is True


def test_a_send_failing_in_one_sharding_raises_on_every_rank():
    run_ranks(_second_send_fails, 3, deadline_s=300)


# ------------------------------------------- one sharding raising in mid-step


def _long_first_bag(kjt: KeyedJaggedTensor, feature: str, ids: int) -> KeyedJaggedTensor:
    """``kjt`` with ``ids`` more ids (0: a row of every table, in the first row block)
    at the start of ``feature``'s first bag."""
    keys, batch = kjt.keys(), kjt.stride()
    at = keys.index(feature) * batch
    start = int(kjt.offsets()[at])
    lengths = kjt.lengths().clone()
    lengths[at] += ids
    values = kjt.values()
    values = torch.cat([values[:start], torch.zeros(ids, dtype=values.dtype), values[start:]])
    weights = kjt.weights_or_none()
    if weights is not None:
        weights = torch.cat([weights[:start], torch.ones(ids), weights[start:]])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _logged_step(ebc, log: List[str]) -> Callable[[], None]:
    """Logs the next step's lookups and output exchanges into ``log``, by sharding
    ("lookup 0", "output 0", ...); the second sharding's output exchange then raises on
    every rank once it has put and taken the step's rows: where the GPU path checks a
    training step (``check_now``), which the host exchanges do at the receive. Returns
    what removes the lookups' hooks."""
    hooks = [
        lookup.register_forward_pre_hook(functools.partial(lambda i, *_: log.append(f"lookup {i}"), i))
        for i, lookup in enumerate(ebc._lookups)
    ]
    for i, exchange in enumerate(ebc._pgas_exchanges):
        original = exchange.exchange_pooled

        def logged(local_embs, route, i=i, exchange=exchange, original=original):
            del exchange.exchange_pooled  # the next step's is the class's again
            log.append(f"output {i}")
            out = original(local_embs, route)
            if i == 1:
                raise PgasInputError(f"{exchange._name} step {exchange._out_step}: refused at its output")
            return out

        exchange.exchange_pooled = logged
    return lambda: [h.remove() for h in hooks]


def _step_counts(ebc) -> List[tuple]:
    """Each sharding's counts of steps sent, received, output and back-propagated."""
    return [(x._send_step, x._recv_step, x._out_step, x._grad_step) for x in ebc._pgas_exchanges]


def _raised_alike(message: str, ebc, world_size: int) -> None:
    """Every rank raised ``message``, and no sharding of ``ebc`` is a step ahead of
    another (on any rank)."""
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (message, _step_counts(ebc)))
    assert all(e == everyone[0] for e in everyone), everyone
    counts = everyone[0][1]
    assert all(c == counts[0] for c in counts), counts


def _second_sharding_raises(rank, world_size, stage, weighted):
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}
    for seed in range(2):
        tables = _tables(world_size, 20 + seed, PoolingType.MEAN)
        ref, pgas, forced, _ = _models(world_size, tables, weighted, seed, fused_params=fused)
        ebc = pgas.module.ebc
        keys = [f for t in tables for f in t.feature_names]
        keys = [keys[i] for i in torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed))]

        def batch(step, batch_size=None):
            size = BATCH_SIZES[world_size][rank] + step if batch_size is None else batch_size
            return in_order(random_kjt(tables, size, 1000 * seed + 10 * step + rank, weighted), keys)

        def good(step, train):
            # The oracle, TorchRec's path of the same plan, never sees the bad batch.
            kjt = batch(step)
            with torch.set_grad_enabled(train):
                outs = [model(kjt) for model in (pgas, forced)]
                assert _joined(outs[0]) == train, (seed, step)
                assert_same_kt(outs[0], outs[1], exact=True)
                if train:
                    for kt in outs:
                        kt = kt.to_dict()
                        g = torch.Generator().manual_seed(step)
                        sum((kt[k] * torch.randn(kt[k].shape, generator=g)).sum() for k in sorted(kt)).backward()
            if step == 0:
                expected = reference_pooled(tables, ref.state_dict(), kjt, _row_wise(world_size, tables))
                assert_close_to_reference(outs[0].to_dict(), expected)

        good(0, train=False)  # the first batch decides the path and sizes the slots
        good(1, train=True)
        second = ebc._pgas_exchanges[1]
        names = ebc._sharding_types
        bad = batch(2, batch_size=2)
        if stage == "receive":
            # Rank 1's batch has more ids for one owner of the second sharding than its
            # slots take; the first sharding's features are within its capacity.
            feature = ebc._embedding_shardings[1].feature_names()[0]
            if rank == 1:
                bad = _long_first_bag(bad, feature, second._layout.ids_capacity + 1)
            message = rf"^{names[1]} step \d+: rank 1's batch .* is over capacity"
        else:
            log: List[str] = []
            unhook = _logged_step(ebc, log)
            message = rf"^{names[1]} step \d+: refused at its output"
        with torch.set_grad_enabled(seed == 0), pytest.raises(PgasInputError, match=message) as info:
            pgas(bad)
        if stage == "output":
            unhook()
            # Each sharding's output exchange right after its own lookup: a sharding that
            # raises there leaves the later shardings' lookups unrun.
            assert log == ["lookup 0", "output 0", "lookup 1", "output 1"], log
        assert names[0] not in str(info.value)
        _raised_alike(str(info.value), ebc, world_size)
        # The next steps are right on every rank, forward and training, and so are the
        # trained weights.
        good(3, train=False)
        good(4, train=True)
        good(5, train=True)
        like = ref.state_dict()
        trained = [gather_unsharded_state_dict(m, like, prefix="ebc.") for m in (pgas, forced)]
        for name in like:
            assert torch.equal(trained[0][name], trained[1][name]), (seed, name)
            assert not torch.equal(trained[0][name], like[name]), f"{name} was not trained"
        assert ebc._pgas_direct is True and len(names) == 2


@pytest.mark.parametrize("stage", ["receive", "output"])
@pytest.mark.parametrize("world_size,weighted", [(2, True), (3, False)])
def test_the_second_sharding_raising_in_mid_step_leaves_the_module_in_step(world_size, weighted, stage):
    """A step that the second of a module's two shardings raises for, after the first
    has taken its part of the step: at its receive (rank 1's batch over the second's
    capacity only, the realistic fault on the host transport) or, on every rank, after
    its output exchange (where the GPU path checks a training step; each sharding's
    output runs right after its own lookup, so a raise leaves later lookups unrun).
    Every rank raises the same error naming the sharding and the problem; every
    sharding has then taken as many steps as the other, and the next steps, forward
    and training, equal TorchRec's path of the same plan exactly (outputs and trained
    weights), which never saw the bad batch. World size 2 puts the row-wise sharding
    first, 3 second (its mean's divisors must stay in step)."""
    run_ranks(_second_sharding_raises, world_size, stage=stage, weighted=weighted, deadline_s=300)


def test_gpu_routing_takes_other_features_in_any_order():
    """Both GPU routings take batches that hold other shardings' features, in any order
    of few enough runs: table-wise puts each owner's runs wherever they are, row-wise
    buckets the whole batch and sends each owner its runs (``test_rw_device_routing``)."""
    from torchrec_pgas.sharding.device_routing import RowBlockIds, TableWiseIds

    rw = RowBlockIds(torch.tensor([4, 7]), 2)
    assert rw.routable([0, 1]) and rw.routable([0, 1], 3) and rw.routable([1, 2], 3) and rw.routable([1, 0])
    tw = TableWiseIds([1, 2])
    assert tw.routable([4, 0, 2], 5) and tw.routable([0, 1, 2], 3)


# ------------------------------------------------------- mixed with TorchRec's


def _with_torchrec_types(rank, world_size):
    counter = _TorchRecInputDists()
    tables = _tables(world_size, 1, PoolingType.SUM)
    torch.manual_seed(1)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(options=PgasOptions(timeout_s=30))
    # pgas_table_wise and pgas_row_wise beside TorchRec's table_wise.
    gens = [pgas_rw(), torchrec_tw(1), pgas_tw(1), pgas_rw(), pgas_tw(0)]
    model = shard(ref, {t.name: g for t, g in zip(tables, gens)}, world_size, sharder)
    for step in range(2):
        kjt = random_kjt(tables, BATCH_SIZES[world_size][rank] + step, 10 * step + rank)
        out = model(kjt).to_dict()
        assert_close_to_reference(out, reference_pooled(tables, ref.state_dict(), kjt))
    assert model.module.ebc._pgas_direct is False
    assert counter.of(model) == 2


def test_modules_mixing_torchrec_types_keep_torchrec_path():
    run_ranks(_with_torchrec_types, 2, deadline_s=300)
