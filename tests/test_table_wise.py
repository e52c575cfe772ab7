"""pgas_table_wise through DistributedModelParallel, on real gloo process groups,
against the unsharded EmbeddingBagCollection and TorchRec's own table_wise."""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import (
    Float64Training,
    assert_close_to_reference,
    assert_same_kt,
    make_tables,
    pgas_tw,
    random_kjt,
    reference_pooled,
    run_ranks,
    shard,
    torchrec_tw,
    tw_placement,
    upstream_grads,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor, PoolingType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable
from torchrec.distributed.types import LazyAwaitable

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding.tw_base import PgasInputError
from torchrec_pgas.testing import gather_unsharded_state_dict, load_unsharded_state_dict
from torchrec_pgas.types import PgasOptions


def _models(world_size, tables, owners, weighted, seed, fused_params=None, options=None):
    torch.manual_seed(seed)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused_params, options=options)
    pgas = shard(ref, tw_placement(tables, owners, pgas_tw), world_size, sharder)
    tw = shard(ref, tw_placement(tables, owners, torchrec_tw), world_size, sharder)
    return ref, pgas, tw


def _forward(rank, world_size, owners, batch_sizes, pooling, weighted):
    for seed in range(3):
        tables = make_tables(len(owners), seed, pooling)
        ref, pgas, tw = _models(world_size, tables, owners, weighted, seed)
        for step in range(3):
            kjt = random_kjt(tables, batch_sizes[rank], 1000 * seed + 10 * step + rank, weighted)
            grad_mode = torch.no_grad() if step == 2 else torch.enable_grad()
            with grad_mode:
                out = pgas(kjt)
                assert_same_kt(out, tw(kjt), exact=True)
                assert_close_to_reference(out.to_dict(), reference_pooled(tables, ref.state_dict(), kjt))
        # The batches went to the sharding unpermuted, and it routed them in their order.
        sharded = pgas.module.ebc
        assert sharded._pgas_direct
        assert sharded._embedding_shardings[0]._exchange._reordered == (owners != sorted(owners))


@pytest.mark.parametrize(
    "world_size,owners,batch_sizes,pooling,weighted",
    [
        (2, [0, 1, 0, 1], [5, 3], PoolingType.SUM, False),
        (2, [1, 1, 0], [2, 7], PoolingType.MEAN, False),
        (2, [0, 1, 1], [4, 4], PoolingType.SUM, True),
        # rank 1 owns no table
        (3, [0, 2, 0, 2], [4, 1, 6], PoolingType.SUM, False),
        (3, [2, 0, 2], [3, 5, 2], PoolingType.MEAN, True),
    ],
    ids=["w2-sum", "w2-mean", "w2-weighted", "w3-idle-rank", "w3-mean-weighted"],
)
def test_forward_matches_unsharded_and_table_wise(world_size, owners, batch_sizes, pooling, weighted):
    run_ranks(
        _forward,
        world_size,
        owners=owners,
        batch_sizes=batch_sizes,
        pooling=pooling,
        weighted=weighted,
    )


def _direct_steps(rank, world_size):
    tables = make_tables(3, seed=4)
    ref, pgas, tw = _models(world_size, tables, [0, 1, 1], False, seed=4)
    sharded = pgas.module.ebc
    torchrec_steps, tracked = [], []
    compute = sharded.compute_and_output_dist
    sharded.compute_and_output_dist = lambda *a: torchrec_steps.append(1) or compute(*a)
    for step in range(5):
        if step == 3:  # a hook of TorchRec's own steps: the forward takes them again
            sharded.post_lookup_tracker_fn = lambda features, embs, module, _: tracked.append(embs.shape)
        if step == 4:  # so does a hook on a dist, which the direct steps do not call
            sharded.post_lookup_tracker_fn = None
            sharded._output_dists[0].register_forward_hook(lambda *_: tracked.append("dist"))
        kjt = random_kjt(tables, 4 + rank - step % 2, 10 * step + rank)
        for grad_mode in (torch.no_grad(), torch.enable_grad()):
            with grad_mode:
                out = pgas.module.ebc(kjt)
                # TorchRec's output type, indexed lazily as TorchRec's is.
                assert isinstance(out, EmbeddingBagCollectionAwaitable)
                assert isinstance(out["f0"], LazyAwaitable) and not isinstance(out["f0"], torch.Tensor)
                assert_same_kt(pgas(kjt), tw(kjt), exact=True)
        # The first batch decides, in TorchRec's steps, that batches go straight through.
        assert len(torchrec_steps) == {0: 1, 1: 1, 2: 1, 3: 5, 4: 9}[step], step
    assert tracked.count("dist") == 4 and len(tracked) == 8


def test_forward_skips_torchrec_steps_unless_their_hooks_are_set():
    run_ranks(_direct_steps, 2)


def _train(rank, world_size, optimizer, owners, batch_sizes):
    """Bit for bit TorchRec's ``table_wise``; both near the float64 oracle (which
    checks the oracle that the GPU tests use)."""
    fused = {"optimizer": optimizer, "learning_rate": 0.1, "eps": 1e-3}
    tables = make_tables(len(owners), seed=7)
    ref, pgas, tw = _models(world_size, tables, owners, False, seed=7, fused_params=fused)
    exact = Float64Training(tables, ref.state_dict(), optimizer, 0.1, 1e-3)
    for step in range(5):
        batches = [random_kjt(tables, batch_sizes[r], 100 * step + r) for r in range(world_size)]
        outs = []
        for model in (pgas, tw):
            kt = model(batches[rank]).to_dict()
            loss = sum((kt[k] * u).sum() for k, u in upstream_grads(kt, step).items())
            loss.backward()
            outs.append({k: v.detach() for k, v in kt.items()})
        for k in outs[1]:
            assert torch.equal(outs[0][k], outs[1][k]), (step, k)
        expected = exact.step(batches, lambda pooled: upstream_grads(pooled, step))
        assert_close_to_reference(outs[1], expected[rank])
    like = ref.state_dict()
    w_pgas = gather_unsharded_state_dict(pgas, like, prefix="ebc.")
    w_tw = gather_unsharded_state_dict(tw, like, prefix="ebc.")
    for name in w_tw:
        assert torch.equal(w_pgas[name], w_tw[name]), name
        assert not torch.equal(w_pgas[name], like[name]), f"{name} was not trained"
    assert_close_to_reference(w_tw, exact.weights)


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD])
@pytest.mark.parametrize(
    "world_size,owners,batch_sizes",
    [(2, [0, 1, 1, 0], [6, 3]), (3, [0, 0, 2], [2, 5, 4])],
    ids=["w2", "w3-idle-rank"],
)
def test_training_matches_table_wise(optimizer, world_size, owners, batch_sizes):
    run_ranks(_train, world_size, optimizer=optimizer, owners=owners, batch_sizes=batch_sizes)


def _checkpoint(rank, world_size, path):
    tables = make_tables(4, seed=3)
    torch.manual_seed(3)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder()
    pgas = shard(ref, tw_placement(tables, [0, 1, 1, 0], pgas_tw), world_size, sharder)
    torch.manual_seed(4)  # other weights, and other owners: the load must reshard
    other = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    tw = shard(other, tw_placement(tables, [1, 0, 0, 1], torchrec_tw), world_size, sharder)
    kjt = random_kjt(tables, 3 + rank, seed=rank)

    dcp.save(pgas.state_dict(), checkpoint_id=f"{path}/pgas")
    sd = tw.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/pgas")
    tw.load_state_dict(sd)
    assert_same_kt(tw(kjt), pgas(kjt), exact=True)

    # and back: TorchRec's table_wise checkpoint into a pgas_table_wise model
    torch.manual_seed(5)
    fresh = shard(
        EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
        tw_placement(tables, [1, 1, 0, 0], pgas_tw),
        world_size,
        sharder,
    )
    dcp.save(tw.state_dict(), checkpoint_id=f"{path}/tw")
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/tw")
    fresh.load_state_dict(sd)
    assert_same_kt(fresh(kjt), ref(kjt), exact=False)


def test_state_dict_interchangeable_with_table_wise(tmp_path):
    run_ranks(_checkpoint, 2, path=str(tmp_path))


def _bad_input(rank, world_size):
    tables = make_tables(3, seed=1)
    options = PgasOptions(timeout_s=20, headroom=1.5)
    _, pgas, tw = _models(world_size, tables, [0, 1, 0], False, seed=1, options=options)
    good = random_kjt(tables, 4, seed=rank)
    assert_same_kt(pgas(good), tw(good), exact=True)  # sizes the buffers: 128 samples, the least
    bad = random_kjt(tables, 4, seed=rank)
    if rank == 1:
        values = bad.values()
        values[-1] = tables[2].num_embeddings  # one past the end of t2
    with pytest.raises(PgasInputError, match=r"rank 1 sent id \d+ for feature 'f2' of table 't2'"):
        pgas(bad)
    negative = random_kjt(tables, 4, seed=rank)
    if rank == 0:
        negative.values()[0] = -3
    with pytest.raises(PgasInputError, match="rank 0 sent id -3 for feature 'f0'"):
        pgas(negative)
    big = random_kjt(tables, 4 if rank == 0 else 200, seed=rank)  # past the least capacity
    with pytest.raises(
        PgasInputError, match=r"rank 1.s batch \(200 samples.* over capacity: the slots take 128 samples"
    ):
        pgas(big)
    assert_same_kt(pgas(good), tw(good), exact=True)
    # Owners in feature order, then out of it (TorchRec permutes the KJT, trusting its
    # lengths: the sharded module checks them first). TorchRec validates the first
    # batch of a model itself, so feed a good one first.
    for owners in ([0, 0, 1], [1, 0, 1]):
        _, pgas, tw = _models(world_size, tables, owners, False, seed=1, options=options)
        assert_same_kt(pgas(good), tw(good), exact=True)
        for cut in (slice(None, -1), slice(None)):  # fewer values than lengths, and more
            torn = random_kjt(tables, 4, seed=rank)
            if rank == 1:
                values = torn.values()[cut] if cut.stop else torch.cat([torn.values(), torn.values()[:2]])
                torn = KeyedJaggedTensor(keys=torn.keys(), values=values, lengths=torn.lengths())
            with pytest.raises(PgasInputError, match="rank 1 sent a KJT whose lengths and values disagree"):
                pgas(torn)
            # the next valid batch is served, and right
            assert_same_kt(pgas(good), tw(good), exact=True)


def test_bad_input_raises_on_every_rank_and_next_batch_is_served():
    run_ranks(_bad_input, 2)


def _evaluation_batches(rank, world_size):
    """Training at a small batch, then evaluation at a batch past its capacity, as
    TorchRec users run them: served, and equal to ``table_wise``, where the options
    give the largest batch; refused naming the option where they do not."""
    tables = make_tables(3, seed=6)
    for max_batch_size in (600, None):
        options = PgasOptions(timeout_s=20, max_batch_size=max_batch_size)
        _, pgas, tw = _models(world_size, tables, [0, 1, 1], False, seed=6, options=options)
        for step in range(2):  # the first batch sizes the buffers: 128 samples (the least)
            kjt = random_kjt(tables, 5 + rank, seed=10 * step + rank)
            assert_same_kt(pgas(kjt), tw(kjt), exact=True)
        with torch.no_grad():
            for step in range(2):
                kjt = random_kjt(tables, 600 - 7 * rank * step, seed=100 + 10 * step + rank)
                if max_batch_size is None:
                    with pytest.raises(PgasInputError, match=r"over capacity.*PgasOptions\.max_batch_size"):
                        pgas(kjt)
                else:
                    assert_same_kt(pgas(kjt), tw(kjt), exact=True)


def test_evaluation_batches_larger_than_training_ones():
    run_ranks(_evaluation_batches, 2)


def _long_bags(tables, batch_size, length, seed):
    g = torch.Generator().manual_seed(seed)
    keys = [f for t in tables for f in t.feature_names]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    values = torch.cat([torch.randint(0, r, (batch_size * length,), generator=g) for r in rows])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.full((len(keys) * batch_size,), length))


def _ids_per_sample_of_each_rank(rank, world_size):
    """First batches whose largest size (rank 1: 30 samples of 1 id per bag) and
    largest id count (rank 0: 4 samples of 200) are two ranks': the slots take
    ``max_batch_size`` samples at rank 0's ids per sample, not at the ratio of the two
    maxima (then rank 0's 64-sample batch, 25,600 ids for one owner, was refused)."""
    tables = make_tables(3, seed=7)
    options = PgasOptions(timeout_s=20, max_batch_size=64)
    _, pgas, tw = _models(world_size, tables, [0, 1, 1], False, seed=7, options=options)
    first = _long_bags(tables, 4, 200, rank) if rank == 0 else _long_bags(tables, 30, 1, rank)
    assert_same_kt(pgas(first), tw(first), exact=True)
    with torch.no_grad():
        big = _long_bags(tables, 64, 200, 10 + rank) if rank == 0 else _long_bags(tables, 64, 1, 10 + rank)
        assert_same_kt(pgas(big), tw(big), exact=True)


def test_evaluation_batches_at_the_ids_per_sample_of_each_rank():
    run_ranks(_ids_per_sample_of_each_rank, 2)


def _planner(rank, world_size):
    from dist_utils import Wrapper
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    import torchrec_pgas

    torchrec_pgas.register()
    try:
        tables = make_tables(4, seed=11)
        torch.manual_seed(11)
        ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        constraints = {
            "t0": ParameterConstraints(sharding_types=["pgas_table_wise"]),
            "t2": ParameterConstraints(sharding_types=["pgas_table_wise"]),
            "t1": ParameterConstraints(sharding_types=["table_wise"]),
            "t3": ParameterConstraints(sharding_types=["table_wise"]),
        }
        topology = Topology(world_size=world_size, compute_device="cpu")
        model = Wrapper(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
        typo = {"t0": ParameterConstraints(sharding_types=["pgas_tabel_wise"])}
        with pytest.raises(ValueError, match=r"unknown sharding type.*'pgas_tabel_wise'"):
            EmbeddingShardingPlanner(topology=topology, constraints=typo).collective_plan(
                model, pg=dist.GroupMember.WORLD
            )
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
        plan = planner.collective_plan(model, pg=dist.GroupMember.WORLD)
        types = {t: ps.sharding_type for t, ps in plan.plan["ebc"].items()}
        assert types == {"t0": "pgas_table_wise", "t1": "table_wise", "t2": "pgas_table_wise", "t3": "table_wise"}
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=None)
        load_unsharded_state_dict(dmp, ref.state_dict(), prefix="ebc.")
        kjt = random_kjt(tables, 2 + 3 * rank, seed=rank)
        assert_same_kt(dmp(kjt), ref(kjt), exact=False)
    finally:
        torchrec_pgas.unregister()


def test_stock_planner_and_dmp_without_sharders_after_register():
    run_ranks(_planner, 2)


def _abandoned(rank, world_size):
    from torchrec_pgas.transport import PgasError

    tables = make_tables(3, seed=7)
    ref, pgas, _ = _models(world_size, tables, [1, 0, 1], False, seed=7)
    sharded = pgas.module.ebc
    # A pipeline starts input dists and drops them (an eval loop after training, a
    # pipeline detached or re-attached): later batches must still get their own ids.
    stale = [random_kjt(tables, 5, 100 + 10 * i + rank) for i in range(3)]
    pending = sharded.input_dist(sharded.create_context(), stale[0])
    for step in range(4):
        for kjt in stale[: step % 3]:
            sharded.input_dist(sharded.create_context(), kjt)
        kjt = random_kjt(tables, 3 + rank, 10 * step + rank)
        assert_close_to_reference(pgas(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt))
    with pytest.raises(PgasError, match="received already or dropped for a later batch"):
        pending.wait().wait()


def test_batches_whose_input_dist_was_dropped_do_not_shift_later_ones():
    run_ranks(_abandoned, 2)


class _TrainStep(nn.Module):
    """What TrainPipelineSparseDist runs: a batch's (loss, output). The loss is zero, so
    the weights stay as they were and the reference stays valid."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        return (pooled * 0).sum(), pooled


def _pipeline_then_direct(rank, world_size):
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    tables = make_tables(3, seed=9)
    torch.manual_seed(9)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    )
    model = shard(ref, tw_placement(tables, [1, 0, 1], pgas_tw), world_size, sharder, wrapper=_TrainStep)

    def endless():
        for i in itertools.count():
            kjt = random_kjt(tables, 4, 10 * i + rank)
            yield Batch(dense_features=torch.zeros(4, 1), sparse_features=kjt, labels=torch.zeros(4))

    pipeline = TrainPipelineSparseDist(model, model.fused_optimizer, torch.device("cpu"))
    batches = endless()
    for _ in range(3):
        pipeline.progress(batches)
    # The pipeline had started the next batch's input dist; it is never waited for.
    pipeline.detach()
    for step in range(3):
        kjt = random_kjt(tables, 2 + rank, 1000 + 10 * step + rank)
        assert_close_to_reference(model.module.ebc(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt))


def test_direct_calls_after_a_training_pipeline_get_their_own_ids():
    run_ranks(_pipeline_then_direct, 2)
