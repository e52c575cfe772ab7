"""pgas_table_wise and pgas_row_wise serving of TorchRec's quantized EmbeddingBagCollection
(INT8, INT4, FP16 tables) on real gloo process groups, against the unsharded quantized
module (FBGEMM's int-N kernel): table-wise tables equal it bit for bit, row-wise ones
within fp32 rounding (RW_RTOL, RW_ATOL)."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import in_order, make_tables, random_kjt, run_ranks
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingEnv, ShardingPlan
from torchrec.inference.modules import quantize_embeddings
from torchrec.modules.embedding_configs import PoolingType

from torchrec_pgas.quant import (
    PgasQuantEmbeddingBagCollection,
    PgasQuantEmbeddingBagCollectionSharder,
    plan_quant_model,
    shard_quant_model,
)
from torchrec_pgas.sharding.tw_base import PgasInputError
from torchrec_pgas.sharding_plan import pgas_table_wise

DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "fp16": torch.half}


class _Model(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt)


def _quantized(tables, dtype, weighted, seed, output_dtype=torch.float32):
    """The same quantized module on every rank (same seed, same quantization)."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    return quantize_embeddings(_Model(ebc), dtype=DTYPES[dtype], inplace=True, output_dtype=output_dtype).ebc


def _check_served(rank, world_size, dtype, owners, weighted, seed):
    tables = make_tables(len(owners), seed)
    ref = _quantized(tables, dtype, weighted, seed)
    model = shard_quant_model(
        _Model(_quantized(tables, dtype, weighted, seed)),
        dist.group.WORLD,
        owners={t.name: o for t, o in zip(tables, owners)},
    )
    assert isinstance(model.ebc, PgasQuantEmbeddingBagCollection)
    for step in range(4):
        # Uneven batches, an empty one on rank 1 at step 2, empty bags throughout.
        batch = 0 if (rank, step) == (1, 2) else 3 + 5 * rank + step
        kjt = random_kjt(tables, batch, seed + 100 * step + rank, weighted=weighted)
        out, expected = model(kjt), ref(kjt)
        assert out.keys() == expected.keys()
        assert out.values().dtype == expected.values().dtype
        assert torch.equal(out.values(), expected.values()), (
            dtype,
            step,
            (out.values() - expected.values()).abs().max(),
        )


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("owners,weighted", [((0, 1, 1, 0, 1), False), ((1, 1, 1), True)])
def test_equals_unsharded_quant(dtype, owners, weighted):
    """Output equal to the unsharded module's; (1, 1, 1): rank 0 owns no table."""
    run_ranks(_check_served, 2, dtype=dtype, owners=owners, weighted=weighted, seed=len(owners) + len(dtype))


def _check_bad_ids(rank, world_size, seed):
    tables = make_tables(3, seed)
    ref = _quantized(tables, "int8", False, seed)
    model = shard_quant_model(_Model(_quantized(tables, "int8", False, seed)), dist.group.WORLD)
    kjt = random_kjt(tables, 4 + rank, seed + rank)
    if rank == 1:
        values = kjt.values().clone()
        values[-1] = tables[-1].num_embeddings  # one past the table's last row
        kjt = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    with pytest.raises(PgasInputError, match="rank 1"):
        model(kjt)
    # Features the module lacks: refused on every rank too.
    missing = random_kjt(tables[:2], 3, seed)
    with pytest.raises(PgasInputError, match=r"rank 0 could not send its batch: its features \[.f0., .f1.\] are not"):
        model(missing if rank == 0 else random_kjt(tables, 3, seed))
    kjt = random_kjt(tables, 2 + 3 * rank, seed + 7 + rank)
    assert torch.equal(model(kjt).values(), ref(kjt).values())


def test_bad_input_raises_on_every_rank():
    run_ranks(_check_bad_ids, 2, seed=5)


def _check_sharder_plan(rank, world_size, seed):
    tables = make_tables(4, seed)
    qebc = _quantized(tables, "fp16", False, seed)
    ref = _quantized(tables, "fp16", False, seed)
    sharder = PgasQuantEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        qebc, {t.name: pgas_table_wise(rank=i % 2) for i, t in enumerate(tables)}, world_size=2, sharder=sharder
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharded = sharder.shard(qebc, plan, env, torch.device("cpu"))
    kjt = random_kjt(tables, 3 + rank, seed + rank)
    assert torch.equal(sharded(kjt).values(), ref(kjt).values())
    # A plan naming pgas_row_wise for some tables: row blocks on every rank.
    params = dict(plan)
    for name in ("t0", "t3"):
        params[name] = ParameterSharding(sharding_type="pgas_row_wise", compute_kernel="quant", ranks=[0, 1])
    mixed = sharder.shard(_quantized(tables, "fp16", False, seed), params, env, torch.device("cpu"))
    assert mixed.local_row_wise is not None
    torch.testing.assert_close(mixed(kjt).values(), ref(kjt).values(), rtol=RW_RTOL, atol=RW_ATOL)


def test_sharder_takes_a_torchrec_plan():
    run_ranks(_check_sharder_plan, 2, seed=11)


def _check_planned(rank, world_size, seed):
    tables = make_tables(5, seed)
    ref = _quantized(tables, "int8", False, seed)
    constraints = {t.name: ParameterConstraints(sharding_types=["pgas_table_wise"]) for t in tables}
    model = _Model(_quantized(tables, "int8", False, seed))
    plan = plan_quant_model(model, dist.group.WORLD, constraints)
    params = plan.get_plan_for_module("ebc")
    assert sorted(params) == sorted(t.name for t in tables)
    assert {p.sharding_type for p in params.values()} == {"pgas_table_wise"}
    assert {p.compute_kernel for p in params.values()} == {"quant"}
    # Every rank got rank 0's plan, and the planner used both ranks.
    owners = {t: p.ranks[0] for t, p in params.items()}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, owners)
    assert gathered[0] == gathered[1] and set(owners.values()) == {0, 1}, gathered
    model = shard_quant_model(model, dist.group.WORLD, constraints=constraints, topology=Topology(2, "cpu"))
    assert isinstance(model.ebc, PgasQuantEmbeddingBagCollection)
    for step in range(3):
        kjt = random_kjt(tables, 2 + 3 * rank + step, seed + 10 * step + rank)
        assert torch.equal(model.ebc(kjt).values(), ref(kjt).values()), step
    # The same plan, handed over: the same placement.
    again = shard_quant_model(_Model(_quantized(tables, "int8", False, seed)), dist.group.WORLD, plan=plan)
    kjt = random_kjt(tables, 4 + rank, seed + 99 + rank)
    assert torch.equal(again(kjt).values(), ref(kjt).values())


def test_planner_constraints_place_quant_tables():
    """ParameterConstraints naming pgas_table_wise plan INT8 tables through TorchRec's
    EmbeddingShardingPlanner; served output equals the unsharded quantized module's."""
    run_ranks(_check_planned, 2, seed=17)


def _check_bad_constraints(rank, world_size, seed):
    tables = make_tables(3, seed)
    tables[2].num_embeddings = world_size - 1  # too few rows for a row block on every rank
    model = _Model(_quantized(tables, "int8", False, seed))
    cases = [
        ({"sharding_types": ["pgas_table_wise", "table_wise"]}, r"table 't1' name sharding type\(s\) \['table_wise'\]"),
        ({"sharding_types": ["pgas_row_wise", "row_wise"]}, r"table 't1' name sharding type\(s\) \['row_wise'\]"),
        ({"compute_kernels": ["fused"]}, r"compute kernel\(s\) \['fused'\]"),
    ]
    for kwargs, match in cases:
        constraints = {"t1": ParameterConstraints(**kwargs)}
        with pytest.raises(ValueError, match=match):
            shard_quant_model(model, dist.group.WORLD, constraints=constraints)
    only_row_wise = {"t2": ParameterConstraints(sharding_types=["pgas_row_wise"])}
    with pytest.raises(ValueError, match=rf"table 't2' allow only pgas_row_wise, but its {world_size - 1} rows leave"):
        shard_quant_model(model, dist.group.WORLD, constraints=only_row_wise)
    # A row-wise plan that is not TorchRec's row_wise over this world: refused, not
    # served other than it reads.
    params = {
        "t0": ParameterSharding(sharding_type="pgas_row_wise", compute_kernel="quant", ranks=[0]),
        "t1": ParameterSharding(sharding_type="pgas_table_wise", compute_kernel="quant", ranks=[0]),
        "t2": ParameterSharding(sharding_type="pgas_table_wise", compute_kernel="quant", ranks=[world_size - 1]),
    }
    with pytest.raises(ValueError, match=r"table 't0' is planned on ranks \[0\]; a row-wise table has a row block"):
        shard_quant_model(model, dist.group.WORLD, plan=ShardingPlan({"ebc": EmbeddingModuleShardingPlan(params)}))
    # Every rank, but not row_wise's blocks: rank 0 all rows but one per other rank.
    rows = tables[0].num_embeddings
    sizes = [rows - world_size + 1] + [1] * (world_size - 1)
    uneven = EnumerableShardingSpec(
        [ShardMetadata([sum(sizes[:r]), 0], [sizes[r], 16], f"rank:{r}/cpu") for r in range(world_size)]
    )
    params["t0"] = ParameterSharding("pgas_row_wise", "quant", list(range(world_size)), uneven)
    with pytest.raises(
        ValueError,
        match=rf"table 't0'.s plan has shards .* \(rank, first row, rows\) \[\(0, 0, {-(-rows // world_size)}\)",
    ):
        shard_quant_model(model, dist.group.WORLD, plan=ShardingPlan({"ebc": EmbeddingModuleShardingPlan(params)}))
    with pytest.raises(ValueError, match=r"tables \['nope'\] that no QuantEmbeddingBagCollection"):
        plan_quant_model(model, dist.group.WORLD, {"nope": ParameterConstraints(sharding_types=["pgas_table_wise"])})
    # A planner failure on rank 0 (no device can hold a table) raises on every rank too.
    tiny = Topology(world_size, "cpu", hbm_cap=64, ddr_cap=64)
    with pytest.raises(RuntimeError, match="planning the quantized tables failed on rank 0"):
        plan_quant_model(model, dist.group.WORLD, topology=tiny)
    # Still collective afterwards: a good plan follows.
    plan = plan_quant_model(model, dist.group.WORLD)
    assert {p.sharding_type for p in plan.get_plan_for_module("ebc").values()} == {"pgas_table_wise"}


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_constraints_raise_on_every_rank(world_size):
    run_ranks(_check_bad_constraints, world_size, seed=23)


def _check_row_wise(rank, world_size, dtype, pooling, weighted, seed, output_dtype=torch.float32):
    tables = make_tables(3, seed, pooling)
    tables[1].num_embeddings = 37  # an uneven last row block: 19 and 18 rows
    ref = _quantized(tables, dtype, weighted, seed, output_dtype)
    owners = {"t0": "pgas_row_wise", "t1": "pgas_row_wise", "t2": 1}
    model = shard_quant_model(
        _Model(_quantized(tables, dtype, weighted, seed, output_dtype)), dist.group.WORLD, owners=owners
    )
    # fp16 output: the partial sums are rounded to fp16 before they are added.
    rtol, atol = (RW_RTOL, RW_ATOL) if output_dtype == torch.float32 else (2e-3, 2e-3)
    assert model.ebc.local_row_wise.embedding_bag_configs()[1].num_embeddings == (19, 18)[rank]
    worst = 0.0
    for step in range(4):
        # Uneven batches, an empty one on rank 0 at step 1, empty bags throughout.
        batch = 0 if (rank, step) == (0, 1) else 2 + 4 * rank + step
        kjt = random_kjt(tables, batch, seed + 100 * step + rank, weighted=weighted)
        out, expected = model(kjt), ref(kjt)
        assert out.keys() == expected.keys() and out.values().dtype == expected.values().dtype
        assert out.values().shape == expected.values().shape
        # Partial sums added at the requester: FBGEMM's single pass up to fp32 rounding.
        torch.testing.assert_close(out.values(), expected.values(), rtol=rtol, atol=atol)
        # The table-wise table (t2, the last columns) stays bit for bit.
        width = tables[2].embedding_dim
        assert torch.equal(out.values()[:, -width:], expected.values()[:, -width:])
        worst = max(worst, float((out.values() - expected.values()).abs().max()) if batch else 0.0)
    print(f"rank {rank}: row-wise {dtype} max abs difference from unsharded {worst:.3g}")


#: Row-wise vs FBGEMM's single pass, measured on these inputs: unweighted sums equal;
#: weighted sums within ~3e-8 (fp32 partial sums added in another order); means within
#: ~2e-7 (sum / (count + 1e-6), TorchRec's row_wise divisor, vs FBGEMM's sum / count).
RW_RTOL, RW_ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
@pytest.mark.parametrize("pooling,weighted", [("SUM", False), ("MEAN", False), ("SUM", True), ("MEAN", True)])
def test_row_wise_beside_table_wise(dtype, pooling, weighted):
    """Two tables pgas_row_wise (one of rows uneven over 2 ranks), one pgas_table_wise,
    in one module: output within fp32 rounding of the unsharded quantized module
    (weighted mean bags divided by their number of ids, as FBGEMM's int-N kernel)."""
    run_ranks(_check_row_wise, 2, dtype=dtype, pooling=PoolingType[pooling], weighted=weighted, seed=31 + len(dtype))


def test_row_wise_mean_keeps_an_fp16_output():
    """A row-wise mean table's output stays in the module's output dtype (an fp32
    divisor would promote it, and the whole output with it)."""
    run_ranks(
        _check_row_wise, 2, dtype="int8", pooling=PoolingType.MEAN, weighted=False, seed=41, output_dtype=torch.half
    )


def _check_bad_first_batch(rank, world_size, seed):
    """A first batch that fails TorchRec's validation on one rank raises on every rank
    before anything is sent; the next batch decides the path and is served right."""
    tables = make_tables(3, seed)
    ref = _quantized(tables, "int8", False, seed)
    model = shard_quant_model(
        _Model(_quantized(tables, "int8", False, seed)), dist.group.WORLD, owners={"t0": 0, "t1": 1, "t2": 1}
    )
    model.ebc._direct = None  # decided at the first batch, as on GPUs
    kjt = random_kjt(tables, 3, seed + rank)
    if rank == 1:  # an id count per bag that TorchRec's validation refuses (offsets not from 0)
        kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), offsets=kjt.offsets() + 1)
    with pytest.raises(PgasInputError, match="rank 1 sent an invalid KJT"):
        model(kjt)
    assert model.ebc._direct is None
    kjt = random_kjt(tables, 2 + rank, seed + 10 + rank)
    assert torch.equal(model(kjt).values(), ref(kjt).values())
    assert model.ebc._direct is True


def test_a_bad_first_batch_raises_everywhere_and_decides_nothing():
    run_ranks(_check_bad_first_batch, 2, seed=53)


def test_subclasses_of_the_quantized_module_are_refused():
    """Feature-processed and managed-collision modules subclass the quantized EBC: the
    PGAS module would drop what they add."""

    class Processed(type(_quantized(make_tables(1, 3), "int8", False, 3))):
        pass

    ebc = _quantized(make_tables(1, 3), "int8", False, 3)
    ebc.__class__ = Processed
    with pytest.raises(ValueError, match=r"not its subclasses: ebc \(Processed\)"):
        shard_quant_model(_Model(ebc), None, owners={"t0": 0})


def _check_row_wise_bad_ids(rank, world_size, seed):
    tables = make_tables(2, seed)
    ref = _quantized(tables, "int8", False, seed)
    owners = {"t0": 0, "t1": "pgas_row_wise"}
    model = shard_quant_model(_Model(_quantized(tables, "int8", False, seed)), dist.group.WORLD, owners=owners)
    kjt = random_kjt(tables, 4 + rank, seed + rank)
    if rank == 1:
        values = kjt.values().clone()
        values[-1] = tables[-1].num_embeddings  # one past the row-wise table's last row
        kjt = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    with pytest.raises(PgasInputError, match="rank 1"):
        model(kjt)
    with pytest.raises(PgasInputError, match=r"rank 0 could not send its batch: its features \[.f0.\] are not"):
        model(random_kjt(tables[:1], 3, seed) if rank == 0 else random_kjt(tables, 3, seed))
    for step in range(2):
        kjt = random_kjt(tables, 2 + 3 * rank + step, seed + 7 + rank + step)
        torch.testing.assert_close(model(kjt).values(), ref(kjt).values(), rtol=RW_RTOL, atol=RW_ATOL)
    with pytest.raises(ValueError, match=r"neither ranks of a world of 2 nor 'pgas_row_wise'"):
        shard_quant_model(
            _Model(_quantized(tables, "int8", False, seed)), dist.group.WORLD, owners={"t0": 0, "t1": "rw"}
        )


def test_row_wise_bad_input_raises_on_every_rank():
    run_ranks(_check_row_wise_bad_ids, 2, seed=41)


def _check_planned_row_wise(rank, world_size, dtype, weighted, seed):
    tables = make_tables(6, seed)
    tables[5].num_embeddings = world_size - 1  # too few rows for a row block on every rank
    ref = _quantized(tables, dtype, weighted, seed)
    both = ["pgas_table_wise", "pgas_row_wise"]
    asked = {"t0": ["pgas_row_wise"], "t1": ["pgas_table_wise"], "t2": ["pgas_row_wise"], "t4": both, "t5": both}
    constraints = {t: ParameterConstraints(sharding_types=types) for t, types in asked.items()}
    model = _Model(_quantized(tables, dtype, weighted, seed))
    params = plan_quant_model(model, dist.group.WORLD, constraints).get_plan_for_module("ebc")
    types = {t: p.sharding_type for t, p in params.items()}
    # t3 names no type: table-wise, as before; t5 cannot be row-wise; t4: the planner's pick.
    assert types == {**types, "t0": "pgas_row_wise", "t1": "pgas_table_wise", "t2": "pgas_row_wise"}, types
    assert types["t3"] == "pgas_table_wise" and types["t5"] == "pgas_table_wise" and types["t4"] in both, types
    assert {p.compute_kernel for p in params.values()} == {"quant"}
    for t in tables:
        p = params[t.name]
        if p.sharding_type != "pgas_row_wise":
            continue
        # TorchRec's row_wise: ceil(rows / world) rows per rank in rank order, all columns.
        block = -(-t.num_embeddings // world_size)
        starts = [min(r * block, t.num_embeddings) for r in range(world_size + 1)]
        assert p.ranks == list(range(world_size)), p.ranks
        # Whole quantized rows: as many columns as the bytes TorchRec's sharder plans.
        width = QuantEmbeddingBagCollectionSharder().shardable_parameters(model.ebc)[t.name].shape[1]
        shards = [(s.placement.rank(), s.shard_offsets, s.shard_sizes) for s in p.sharding_spec.shards]
        assert shards == [(r, [starts[r], 0], [starts[r + 1] - starts[r], width]) for r in range(world_size)], (
            t,
            shards,
        )
    gathered = [None] * world_size
    dist.all_gather_object(gathered, types)
    assert all(g == types for g in gathered), gathered

    model = shard_quant_model(model, dist.group.WORLD, constraints=constraints)
    row_wise = [t.name for t in tables if types[t.name] == "pgas_row_wise"]
    assert [t.name for t in model.ebc.local_row_wise.embedding_bag_configs()] == row_wise
    for step in range(3):
        batch = 0 if (rank, step) == (world_size - 1, 1) else 2 + 3 * rank + step
        kjt = random_kjt(tables, batch, seed + 10 * step + rank, weighted=weighted)
        out, expected = model(kjt), ref(kjt)
        assert out.keys() == expected.keys() and out.values().dtype == expected.values().dtype
        got, want = out.to_dict(), expected.to_dict()
        for t in tables:
            (feature,) = t.feature_names
            if types[t.name] == "pgas_row_wise":
                torch.testing.assert_close(got[feature], want[feature], rtol=RW_RTOL, atol=RW_ATOL)
            else:
                assert torch.equal(got[feature], want[feature]), (t.name, step)


@pytest.mark.parametrize("world_size,dtype,weighted", [(2, "int4", False), (3, "int8", True), (3, "fp16", False)])
def test_planner_constraints_place_row_wise(world_size, dtype, weighted):
    """ParameterConstraints naming pgas_row_wise for some quantized tables and
    pgas_table_wise for others: the plan names them so, with TorchRec's row_wise
    row blocks on every rank, and the sharded module serves it, row-wise tables
    within fp32 rounding of the unsharded quantized module, table-wise ones exactly."""
    run_ranks(_check_planned_row_wise, world_size, dtype=dtype, weighted=weighted, seed=53 + world_size)


# The GPU path's pieces that run on the CPU too (tests/test_gpu_quant.py runs the rest).


@pytest.mark.parametrize("as_tensors", [False, True])
@pytest.mark.parametrize("direct", [False, True])
def test_pooling_of_fixed_shape_lookup_groups(direct, as_tensors):
    """``_pool_groups`` on lookup groups laid out as the GPU exchange lays them (bag
    ``(feature, source, sample)`` of ``world * capacity`` per feature, bags past a
    source's batch empty) gives, row ``source * capacity + sample``, the unsharded
    module's output of that source's batch, bit for bit; a weighted module with sum
    and mean tables (two FBGEMM modules, two lookup groups). ``direct``: through
    ``_NBitLookup``s of FBGEMM modules without a bounds check, as on GPUs (each calls
    FBGEMM's operator itself). ``as_tensors``: the groups as the GPU exchange hands
    them to the quantized module (``GroupIds``), not KJTs. On GPUs the index tensors
    are longer than the bags, which FBGEMM's CPU kernel refuses: test_gpu_quant.py."""
    from torchrec_pgas.quant.sharded import _group_sizes, _lookup_order, _NBitLookup, _pool_groups
    from torchrec_pgas.sharding.device_batch import GroupIds

    tables = make_tables(2, 61, PoolingType.MEAN) + make_tables(3, 62, PoolingType.SUM)
    for i, t in enumerate(tables):
        t.name, t.feature_names = f"t{i}", [f"f{i}"]
    module = _quantized(tables, "int4", True, 61)
    lookups = None
    if direct:
        for tbe in module._emb_modules:
            tbe.bounds_check_mode_int = BoundsCheckMode.NONE.value
        lookups = [_NBitLookup(tbe) for tbe in module._emb_modules]
    order = _lookup_order(tables)
    sizes = _group_sizes(order)
    assert sizes == [2, 3]
    world, cap = 3, 6
    batches = [random_kjt(tables, b, 70 + s, weighted=True) for s, b in enumerate([6, 0, 4])]
    groups, first = [], 0
    for size in sizes:
        keys = [f for t in order[first : first + size] for f in t.feature_names]
        first += size
        lengths, values, weights = [], [], []
        for k in keys:
            for kjt in batches:
                jt = kjt[k] if kjt.stride() else None
                n = jt.lengths() if jt is not None else torch.zeros(0, dtype=torch.int64)
                lengths.append(torch.cat([n, torch.zeros(cap - n.numel(), dtype=torch.int64)]))
                if jt is not None:
                    values.append(jt.values())
                    weights.append(jt.weights())
        groups.append(
            KeyedJaggedTensor(
                keys=keys,
                values=torch.cat(values),
                lengths=torch.cat(lengths),
                weights=torch.cat(weights),
                stride=world * cap,
            )
        )
    if as_tensors:
        groups = [GroupIds(kjt.values(), kjt.offsets(), kjt.weights()) for kjt in groups]
    pooled = _pool_groups(module, groups, weighted=True, lookups=lookups)
    assert pooled.shape == (world * cap, sum(t.embedding_dim for t in tables))
    if direct:
        assert all(lookup._args is not None for lookup in lookups)  # FBGEMM's operator, called here
    for s, kjt in enumerate(batches):
        rows = pooled[s * cap : (s + 1) * cap]
        expected = module(kjt).values() if kjt.stride() else rows[:0]
        assert torch.equal(rows[: kjt.stride()], expected), s
        assert torch.equal(rows[kjt.stride() :], torch.zeros_like(rows[kjt.stride() :])), s


class _Casts(TorchDispatchMode):
    """Counts the dtype conversions run under it (a launch each on GPUs)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("weighted", [False, True])
def test_nbit_lookup_equals_the_unsharded_module(dtype, weighted):
    """An owner's FBGEMM modules without a bounds check (as ``_local_module`` builds
    them on GPUs), called through ``_NBitLookup`` with the exchange's int64 ids and
    offsets, pool what the unsharded quantized module's forward does, bit for bit,
    with no dtype conversion on the way (TorchRec's forward casts to int32 on GPUs)."""
    from torchrec_pgas.quant.sharded import _NBitLookup, _pool_groups

    tables = make_tables(4, 71)
    module = _quantized(tables, dtype, weighted, 71)
    kjt = random_kjt(tables, 9, 72, weighted=weighted)
    expected = module(kjt).values()
    for tbe in module._emb_modules:
        tbe.bounds_check_mode_int = BoundsCheckMode.NONE.value
    lookups = [_NBitLookup(tbe) for tbe in module._emb_modules]
    assert len(lookups) == 1 and kjt.values().dtype == kjt.offsets().dtype == torch.int64
    casts = _Casts()
    with casts:
        pooled = _pool_groups(module, [kjt], weighted, lookups)
    assert lookups[0]._args is not None  # FBGEMM's operator, called directly
    assert casts.count == 0
    assert torch.equal(pooled, expected)


def test_nbit_lookup_follows_the_module():
    """``_NBitLookup`` calls the FBGEMM module itself where its forward does more than
    the operator (a bounds check, a hook), and reads the module's tensors again once
    they are replaced: its output is always the module's own forward's."""
    from torchrec_pgas.quant.sharded import _NBitLookup

    tables = make_tables(3, 81)
    module = _quantized(tables, "int8", False, 81)
    tbe = module._emb_modules[0]
    kjt = random_kjt(tables, 7, 82)
    ids, offsets = kjt.values(), kjt.offsets()
    lookup = _NBitLookup(tbe)

    def forward():
        return tbe(indices=ids, offsets=offsets)

    assert tbe.bounds_check_mode_int != BoundsCheckMode.NONE.value
    assert torch.equal(lookup(ids, offsets, None), forward()) and lookup._args is None
    tbe.bounds_check_mode_int = BoundsCheckMode.NONE.value
    assert torch.equal(lookup(ids, offsets, None), forward()) and lookup._args is not None
    calls = []
    handle = tbe.register_forward_hook(lambda m, args, out: calls.append(1))
    lookup(ids, offsets, None)
    assert calls == [1] and lookup._args is None
    handle.remove()
    # Rows replaced (as ``_apply`` or an assignment would): the new ones are read
    # (all zero, scales too: zero output, where the old rows gave another).
    assert forward().abs().sum() > 0
    rows = "weights_host" if tbe.host_size > 0 else "weights_dev"
    setattr(tbe, rows, torch.zeros_like(getattr(tbe, rows)))
    out = lookup(ids, offsets, None)
    assert lookup._args is not None and torch.equal(out, forward())
    assert torch.equal(out, torch.zeros_like(out))


def _check_whole_batches(rank, world_size, seed):
    """The GPU path's sends (every exchange given the whole batch, in the order the
    ranks agreed on at the first batch) on host exchanges: right output for batches
    whose features are in another order than the module's, bad ids and a missing key
    raised on every rank (naming the rank, as the float path does), the next batch
    right; ranks whose first batches disagree in order take the permuting path."""
    tables = make_tables(4, seed)
    ref = _quantized(tables, "int8", False, seed)
    owners = {"t0": 1, "t1": "pgas_row_wise", "t2": 0, "t3": 1}
    for agree in (True, False):
        model = shard_quant_model(_Model(_quantized(tables, "int8", False, seed)), dist.group.WORLD, owners=owners)
        model.ebc._direct = None  # decided at the first batch, as on GPUs
        keys = ["f3", "f1", "f0", "f2"] if agree or rank == 0 else ["f0", "f1", "f2", "f3"]
        for step in range(3):
            kjt = in_order(random_kjt(tables, 3 + 2 * rank + step, seed + 10 * step + rank), keys)
            out, expected = model(kjt), ref(kjt)
            torch.testing.assert_close(out.values(), expected.values(), rtol=RW_RTOL, atol=RW_ATOL)
            assert torch.equal(out.to_dict()["f3"], expected.to_dict()["f3"])
        assert model.ebc._direct is agree
        if not agree:
            continue
        kjt = in_order(random_kjt(tables, 4 + rank, seed + 50 + rank), keys)
        if rank == 1:
            values = kjt.values().clone()
            values[-1] = tables[2].num_embeddings  # f2 is last: one past t2's rows
            kjt = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
        rows = tables[2].num_embeddings
        with pytest.raises(PgasInputError, match=rf"rank 1 sent id {rows} for feature 'f2' of table 't2'"):
            model(kjt)
        missing = in_order(random_kjt(tables, 3, seed), keys)
        if rank == 0:
            missing = random_kjt(tables[:3], 3, seed)
        with pytest.raises(PgasInputError, match="rank 0 sent a KJT whose features are not the model's"):
            model(missing)
        kjt = in_order(random_kjt(tables, 2 + 3 * rank, seed + 70 + rank), keys)
        torch.testing.assert_close(model(kjt).values(), ref(kjt).values(), rtol=RW_RTOL, atol=RW_ATOL)


def test_whole_batch_sends_on_host_exchanges():
    run_ranks(_check_whole_batches, 2, seed=67)


def _check_pruned(rank, world_size):
    ebc = _quantized(make_tables(2, 3), "int8", False, 3)
    ebc.embedding_bag_configs()[1].num_embeddings_post_pruning = 5  # as a pruned table's config says
    with pytest.raises(ValueError, match=r"pruned tables .* \['t1'\]"):
        shard_quant_model(_Model(ebc), dist.group.WORLD, owners={"t0": 0, "t1": 1})


def test_pruned_tables_are_refused():
    """A table pruned by TorchRec's quantization remaps its ids in FBGEMM, which the
    PGAS owners do not apply: refused on every rank, naming it."""
    run_ranks(_check_pruned, 2)


def _check_fuzzed_cases(rank, world_size):
    """Cases a randomized run found: (a) a feature read by two row-wise tables of
    different row counts pools each table's own ids; (b) an unweighted module ignores
    per-sample weights that only some ranks send, as the unsharded module does; (c) a
    VBE batch with fp16 weights on one rank raises the same PgasInputError on every
    rank, and the next batch is served; (d) PgasOptions that differ across ranks are
    refused at sharding, on every rank, naming the field."""
    from torchrec import EmbeddingBagConfig

    from torchrec_pgas.types import PgasOptions

    shared = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=4, feature_names=["f0"]),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=7, feature_names=["f1"]),
    ]
    ref = _quantized(shared, "int8", False, 3)
    model = shard_quant_model(
        _Model(_quantized(shared, "int8", False, 3)),
        dist.group.WORLD,
        owners={"t0": "pgas_row_wise", "t1": "pgas_row_wise", "t2": 1},
    )
    for step in range(3):
        kjt = random_kjt(shared[1:], 2 + rank + step, 40 + 10 * step + rank)  # ids valid for t1 (and t0)
        torch.testing.assert_close(model(kjt).values(), ref(kjt).values(), rtol=RW_RTOL, atol=RW_ATOL)

    tables = make_tables(3, 9)
    ref = _quantized(tables, "int8", False, 9)
    model = shard_quant_model(_Model(_quantized(tables, "int8", False, 9)), dist.group.WORLD)
    kjt = random_kjt(tables, 3 + rank, 50 + rank, weighted=rank == 1)
    assert torch.equal(model(kjt).values(), ref(kjt).values())

    weighted = _quantized(tables, "int8", True, 9)
    model = shard_quant_model(
        _Model(_quantized(tables, "int8", True, 9)), dist.group.WORLD, owners={"t0": 1, "t1": 0, "t2": 1}
    )
    model(random_kjt(tables, 4, 60 + rank, weighted=True))
    kjt = random_kjt(tables, 2, 61 + rank, weighted=True)
    if rank == 0:
        kjt = KeyedJaggedTensor(
            keys=["f0", "f1", "f2"],
            values=torch.tensor([1, 2, 3]),
            lengths=torch.tensor([1, 1, 1, 0]),
            weights=torch.ones(3, dtype=torch.half),
            stride_per_key_per_rank=[[2], [1], [1]],
            inverse_indices=(["f0", "f1", "f2"], torch.zeros(3, 2, dtype=torch.int64)),
        )
    with pytest.raises(PgasInputError, match=r"rank 0 could not send its batch: its batch size varies per feature"):
        model(kjt)
    kjt = random_kjt(tables, 3 + rank, 62 + rank, weighted=True)
    assert torch.equal(model(kjt).values(), weighted(kjt).values())

    options = PgasOptions(headroom=1.0 + rank)
    with pytest.raises(ValueError, match=r"PgasOptions differ across ranks in headroom \(rank 0: 1.0, rank 1: 2.0\)"):
        shard_quant_model(_Model(_quantized(tables, "int8", False, 9)), dist.group.WORLD, options=options)


def test_cases_a_randomized_run_found():
    run_ranks(_check_fuzzed_cases, 2)


def _check_mismatched_ranks(rank, world_size):
    tables = make_tables(3, 71)
    if rank == 1:
        tables[2].num_embeddings += 1
    with pytest.raises(ValueError, match=r"the tables differ across ranks \(table #2: rank 0: 't2': \d+ rows"):
        shard_quant_model(
            _Model(_quantized(tables, "int8", False, 71)), dist.group.WORLD, owners={"t0": 0, "t1": 1, "t2": 0}
        )
    # A plan that only rank 1 cannot take: rank 0 raises too (it waited in the check before).
    tables = make_tables(3, 71)
    owners = {"t0": 0, "t1": 1, "t2": 2 if rank == 1 else 1}
    with pytest.raises(ValueError, match=r"rank 1: .*owners \{'t2': 2\} are neither ranks of a world of 2"):
        shard_quant_model(_Model(_quantized(tables, "int8", False, 71)), dist.group.WORLD, owners=owners)
    # A plan whose entry only rank 1 cannot serve, and one that only rank 1 lacks.
    params = {t.name: ParameterSharding("pgas_table_wise", "quant", ranks=[r]) for t, r in zip(tables, [0, 1, 0])}
    if rank == 1:
        params["t2"] = ParameterSharding("table_wise", "quant", ranks=[0])
    plan = ShardingPlan({"ebc": EmbeddingModuleShardingPlan(params)})
    with pytest.raises(ValueError, match=r"rank 1: module 'ebc': .*serves only .* not \{'t2': 'table_wise'\}"):
        shard_quant_model(_Model(_quantized(tables, "int8", False, 71)), dist.group.WORLD, plan=plan)
    plan = ShardingPlan({"ebc" if rank == 0 else "other": EmbeddingModuleShardingPlan(params)})
    with pytest.raises(ValueError, match=r"rank 1: module 'ebc': the plan has no entry for this module"):
        shard_quant_model(_Model(_quantized(tables, "int8", False, 71)), dist.group.WORLD, plan=plan)


def test_ranks_whose_models_or_plans_differ_are_refused_on_every_rank():
    run_ranks(_check_mismatched_ranks, 2, deadline_s=120)
