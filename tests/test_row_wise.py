"""pgas_row_wise through DistributedModelParallel on real gloo process groups, against
a float64 reference, the unsharded module's training, and TorchRec's row_wise
checkpoints."""

import functools

import pytest
import torch
from dist_utils import assert_close_to_reference, make_tables, random_kjt, reference_pooled, run_ranks, shard
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, PoolingType
from torchrec.distributed.sharding_plan import row_wise

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding_plan import pgas_row_wise, pgas_table_wise
from torchrec_pgas.testing import gather_unsharded_state_dict


def _placement(tables, generator):
    return {t.name: generator(compute_kernel="fused") for t in tables}


def _forward(rank, world_size, pooling, weighted, batch_sizes):
    for seed in range(3):
        tables = make_tables(3, seed, pooling)
        torch.manual_seed(seed)
        ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
        model = shard(ref, _placement(tables, pgas_row_wise), world_size, PgasEmbeddingBagCollectionSharder())
        for step in range(3):
            kjt = random_kjt(tables, batch_sizes[rank], 100 * seed + 10 * step + rank, weighted)
            with torch.no_grad() if step == 1 else torch.enable_grad():
                out = model(kjt).to_dict()
            assert_close_to_reference(out, reference_pooled(tables, ref.state_dict(), kjt, [t.name for t in tables]))


@pytest.mark.parametrize(
    "world_size,pooling,weighted,batch_sizes",
    [
        (2, PoolingType.SUM, False, [5, 2]),
        (2, PoolingType.MEAN, False, [3, 6]),
        (3, PoolingType.SUM, True, [4, 1, 3]),
        (3, PoolingType.MEAN, True, [2, 5, 4]),
        (3, PoolingType.MEAN, False, [3, 0, 2]),
    ],
    ids=["w2-sum", "w2-mean", "w3-weighted", "w3-mean-weighted", "w3-empty-batch"],
)
def test_forward_matches_the_float64_reference(world_size, pooling, weighted, batch_sizes):
    run_ranks(_forward, world_size, pooling=pooling, weighted=weighted, batch_sizes=batch_sizes)


def _train(rank, world_size, pooling, batch_sizes, tables=None):
    """EXACT_SGD on pgas_row_wise against plain SGD on the unsharded module, fed every
    rank's batch: the same update up to float rounding."""
    lr = 0.1
    tables = tables or make_tables(3, seed=9, pooling=pooling)
    torch.manual_seed(9)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr})
    model = shard(ref, _placement(tables, pgas_row_wise), world_size, sharder)
    oracle = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    oracle.load_state_dict(ref.state_dict())
    for step in range(4):
        kjts = [random_kjt(tables, batch_sizes[r], seed=1000 * step + r) for r in range(world_size)]
        g = torch.Generator().manual_seed(step)
        targets = {f"f{i}": torch.randn(10, t.embedding_dim, generator=g) for i, t in enumerate(tables)}
        kt = model(kjts[rank]).to_dict()
        sum((kt[k] * targets[k][: kt[k].size(0)]).sum() for k in kt).backward()
        oracle.zero_grad()
        for r, kjt in enumerate(kjts):  # TorchRec divides by the world size, as DDP does
            if kjt.stride() == 0:
                continue  # an empty batch adds nothing (and TorchRec's EBC cannot take one)
            okt = oracle(kjt).to_dict()
            (sum((okt[k] * targets[k][: okt[k].size(0)]).sum() for k in okt) / world_size).backward()
        with torch.no_grad():
            for p in oracle.parameters():
                p -= lr * p.grad
    trained = gather_unsharded_state_dict(model, ref.state_dict(), prefix="ebc.")
    for name, w in oracle.state_dict().items():
        torch.testing.assert_close(trained[name], w, rtol=1e-5, atol=1e-6)
        assert not torch.equal(trained[name], ref.state_dict()[name]), f"{name} was not trained"


@pytest.mark.parametrize(
    "pooling,batch_sizes",
    [(PoolingType.SUM, [3, 4]), (PoolingType.MEAN, [3, 4]), (PoolingType.MEAN, [3, 0, 2])],
    ids=["sum", "mean", "mean-w3-empty-batch"],
)
def test_training_matches_sgd_on_the_unsharded_module(pooling, batch_sizes):
    run_ranks(_train, len(batch_sizes), pooling=pooling, batch_sizes=batch_sizes)


def _empty_shard(rank, world_size):
    from torchrec import EmbeddingBagConfig

    # ceil(4 / 3) = 2 rows per rank: rank 2 holds none of t0, whose dim differs from t1's.
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=4, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1"]),
    ]
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    # As many rows as ranks would not be enough: the advice says what is.
    advice = r"2 \* ceil\(rows / 3\) < rows, e\.g\. a multiple of 3\), or shard it pgas_table_wise"
    with pytest.raises(ValueError, match=r"table\(s\) \['t0'\] get no rows on rank 2 .*" + advice):
        shard(ref, _placement(tables, pgas_row_wise), world_size, PgasEmbeddingBagCollectionSharder())
    # A rank that gets no row of any table at all, though the table has more rows than ranks.
    alone = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=4, feature_names=["f0"])]
    with pytest.raises(ValueError, match=r"ranks \[2\] get no rows of any table: .*none of tables \['t0'\].*" + advice):
        shard(
            EmbeddingBagCollection(tables=alone, device=torch.device("cpu")),
            _placement(alone, pgas_row_wise),
            world_size,
            PgasEmbeddingBagCollectionSharder(),
        )


def test_an_empty_row_shard_is_refused_on_every_rank_with_the_right_advice():
    run_ranks(_empty_shard, 3)


def _same_group_tables(t0_rows, t1_rows):
    """Two tables of one lookup group (same dim and pooling), t0 first."""
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=t0_rows, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=t1_rows, feature_names=["f1"]),
    ]


def _empty_last_table(rank, world_size):
    # One lookup group (same dim and pooling) whose last table, of 1 row, leaves rank 1
    # none: FBGEMM's CPU backward would read past the group's row offsets there.
    tables = _same_group_tables(10, 1)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"table\(s\) \['t1'\] get no rows on rank 1 .* end their lookup group there"):
        shard(ref, _placement(tables, pgas_row_wise), world_size, PgasEmbeddingBagCollectionSharder())


def test_an_empty_row_shard_ending_its_lookup_group_is_refused_on_every_rank():
    run_ranks(_empty_last_table, 2)


def test_an_empty_row_shard_before_others_of_its_group_trains_right():
    # The same tables in the other order: rank 1's empty table comes first, and trains.
    run_ranks(_train, 2, pooling=PoolingType.SUM, batch_sizes=[4, 3], tables=_same_group_tables(1, 10))


def _empty_group(rank, world_size):
    from torchrec import EmbeddingBagConfig

    # t1 is the only mean table (a lookup group of its own): ceil(2 / 3) = 1 row per
    # rank leaves rank 2 a group with no rows at all; dims are equal.
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=30, feature_names=["f0"]),
        EmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=2, feature_names=["f1"], pooling=PoolingType.MEAN
        ),
    ]
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"table\(s\) \['t1'\] get no rows on rank 2 .* no other table of their lookup"
    ):
        shard(ref, _placement(tables, pgas_row_wise), world_size, PgasEmbeddingBagCollectionSharder())


def test_a_lookup_group_with_no_rows_on_a_rank_is_refused_on_every_rank():
    run_ranks(_empty_group, 3)


def _mixed_row_wise_kinds(rank, world_size):
    tables = make_tables(2, seed=6, pooling=PoolingType.MEAN)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    placement = {"t0": pgas_row_wise(compute_kernel="fused"), "t1": row_wise(compute_kernel="fused")}
    with pytest.raises(
        ValueError, match=r"pgas_row_wise tables \['t0'\] and TorchRec row_wise / table_row_wise features \['f1'\]"
    ):
        shard(ref, placement, world_size, PgasEmbeddingBagCollectionSharder())
    # TorchRec's mean divisor scales a sum-pooled table-wise table's columns too (its
    # own table_wise's alike): refused for pgas_table_wise beside it.
    tables[0].pooling = PoolingType.SUM
    placement = {"t0": pgas_table_wise(rank=1, compute_kernel="fused"), "t1": row_wise(compute_kernel="fused")}
    with pytest.raises(
        ValueError, match=r"pgas_table_wise tables \['t0'\] and TorchRec row_wise / table_row_wise features \['f1'\]"
    ):
        shard(ref, placement, world_size, PgasEmbeddingBagCollectionSharder())


def test_mean_pooling_across_pgas_and_torchrec_row_wise_is_refused_on_every_rank():
    run_ranks(_mixed_row_wise_kinds, 2)


def _checkpoint(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    tables = make_tables(3, seed=4)
    torch.manual_seed(4)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder()
    pgas = shard(ref, _placement(tables, pgas_row_wise), world_size, sharder)
    dcp.save(pgas.state_dict(), checkpoint_id=f"{path}/pgas")
    torch.manual_seed(5)
    other = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    rw = shard(other, _placement(tables, functools.partial(row_wise)), world_size, sharder)
    state = rw.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/pgas")
    rw.load_state_dict(state)
    restored = gather_unsharded_state_dict(rw, ref.state_dict(), prefix="ebc.")
    for name, w in ref.state_dict().items():
        assert torch.equal(restored[name], w), name

    # and back: TorchRec's row_wise checkpoint into a fresh pgas_row_wise model
    dcp.save(rw.state_dict(), checkpoint_id=f"{path}/rw")
    torch.manual_seed(6)
    fresh = shard(
        EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
        _placement(tables, pgas_row_wise),
        world_size,
        sharder,
    )
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/rw")
    fresh.load_state_dict(state)
    kjt = random_kjt(tables, 3 + rank, seed=rank)
    assert_close_to_reference(fresh(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt))


def test_state_dict_interchangeable_with_torchrec_row_wise(tmp_path):
    run_ranks(_checkpoint, 2, path=str(tmp_path))


def _mixed_plan(rank, world_size):
    """One model mixing pgas_row_wise, pgas_table_wise and TorchRec's table_wise, placed
    by the stock planner from constraints, run by DMP without sharders."""
    import torch.distributed as dist
    from dist_utils import Wrapper
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    import torchrec_pgas
    from torchrec_pgas.testing import load_unsharded_state_dict

    torchrec_pgas.register()
    try:
        tables = make_tables(4, seed=13, pooling=PoolingType.MEAN)
        torch.manual_seed(13)
        ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        wanted = {"t0": "pgas_row_wise", "t1": "pgas_table_wise", "t2": "table_wise", "t3": "pgas_row_wise"}
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device="cpu"),
            constraints={t: ParameterConstraints(sharding_types=[s]) for t, s in wanted.items()},
        )
        model = Wrapper(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
        plan = planner.collective_plan(model, pg=dist.GroupMember.WORLD)
        assert {t: ps.sharding_type for t, ps in plan.plan["ebc"].items()} == wanted
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=None)
        load_unsharded_state_dict(dmp, ref.state_dict(), prefix="ebc.")
        for step in range(3):
            kjt = random_kjt(tables, 2 + rank + step, seed=10 * step + rank)
            assert_close_to_reference(dmp(kjt).to_dict(), reference_pooled(tables, ref.state_dict(), kjt))
    finally:
        torchrec_pgas.unregister()


def test_stock_planner_mixes_row_wise_table_wise_and_torchrec_types():
    run_ranks(_mixed_plan, 2)
