"""CUDA graphs of PGAS-sharded models (``torchrec_pgas.graphs``) on the GPU path, every
rank on one GPU as in ``test_gpu_shared.py``: world size 1 through peer mappings, 2
through NVSHMEM's put path, a gloo process group.

A captured step is checked against the same model's eager steps (exactly: the same
kernels on the same inputs) and against the float64 reference of the unsharded EBC's
weights; captured training against the same training run eagerly. A step that cannot
be captured (it reads something back to the host) fails these tests, by design.

Skipped without a GPU and nvshmem4py. On the GPU machine:
    python3 -m pytest -q tests/test_gpu_graphs.py
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("nvshmem.core")

from dist_utils import (  # noqa: E402
    assert_close_to_reference,
    make_tables,
    pgas_tw,
    random_kjt,
    reference_pooled,
    run_ranks,
    shard,
    shared_gpu_options,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torch import nn  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.sharding_plan import construct_module_sharding_plan  # noqa: E402
from torchrec.distributed.types import ShardingEnv, ShardingPlan  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper  # noqa: E402

from torchrec_pgas.graphs import capture, raise_errors  # noqa: E402
from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder  # noqa: E402
from torchrec_pgas.sharding.step_records import RING_ENTRIES  # noqa: E402
from torchrec_pgas.sharding.tw_base import PgasInputError  # noqa: E402
from torchrec_pgas.sharding_plan import pgas_row_wise  # noqa: E402
from torchrec_pgas.testing import gather_unsharded_state_dict, load_unsharded_state_dict  # noqa: E402

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")
#: A test whose ranks still run after this long hangs: every wait times out in 60 s.
DEADLINE_S = 240

#: Layouts of four tables: the tables sharded pgas_row_wise (the others pgas_table_wise).
LAYOUTS = {"tw": (), "rw": ("t0", "t1", "t2", "t3"), "mix": ("t1", "t3")}


def _placement(tables, world_size, row_wise):
    rw = pgas_row_wise(compute_kernel="fused")
    return {t.name: rw if t.name in row_wise else pgas_tw((i + 1) % world_size) for i, t in enumerate(tables)}


def _sharded(world_size, tables, layout, weighted=False, fused=None, wrapper=None):
    """The unsharded EBC and its copy sharded by ``layout`` on the GPU (under DMP); the
    same weights on every rank and in every call."""
    torch.cuda.set_device(GPU)
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=CPU)
    sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused, options=shared_gpu_options(world_size))
    placement = _placement(tables, world_size, LAYOUTS[layout])
    model = shard(ref, placement, world_size, sharder, device=GPU, local_size=1, wrapper=wrapper)
    return ref, model


def fixed_size_kjt(tables, batch_size, seed, weighted=False, ids_per_bag=2):
    """A KJT with ``ids_per_bag * batch_size`` ids per feature spread over the bags at
    random (empty bags included), ids over each table's whole range: fresh lengths and
    ids in the sizes a captured step takes."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            n = ids_per_bag * batch_size
            keys.append(f)
            lengths.append(torch.bincount(torch.randint(0, batch_size, (n,), generator=g), minlength=batch_size))
            values.append(torch.randint(0, t.num_embeddings, (n,), generator=g))
    v = torch.cat(values)
    w = torch.rand(v.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=v, lengths=torch.cat(lengths), weights=w)


def _check_against_reference(out, tables, ref, kjt, layout):
    assert_close_to_reference(out, reference_pooled(tables, ref.state_dict(), kjt, row_wise=LAYOUTS[layout]))


# ----------------------------------------------------------------- (a) forward

#: (layout, pooling, weighted, batch size per rank)
FORWARD_CASES = [
    ("tw", PoolingType.SUM, False, [37, 12]),
    ("tw", PoolingType.MEAN, True, [9, 30]),
    ("rw", PoolingType.SUM, True, [20, 7]),
    ("rw", PoolingType.MEAN, False, [16, 25]),
    ("mix", PoolingType.SUM, False, [11, 26]),
    ("mix", PoolingType.MEAN, True, [23, 5]),
]


def _forward(rank, world_size, layouts):
    for case, (layout, pooling, weighted, sizes) in enumerate(FORWARD_CASES):
        if layout not in layouts:
            continue
        tables = make_tables(4, seed=case, pooling=pooling)
        ref, model = _sharded(world_size, tables, layout, weighted)
        batches = [fixed_size_kjt(tables, sizes[rank], 100 * case + 10 * i + rank, weighted) for i in range(5)]
        with torch.no_grad():
            step = capture(model, batches[0].to(GPU))
            for kjt in batches[1:]:
                graphed = {k: v.clone() for k, v in step(kjt.to(GPU)).to_dict().items()}
                eager = model(kjt.to(GPU)).to_dict()
                assert sorted(graphed) == sorted(eager), case
                for k, v in eager.items():
                    assert torch.equal(graphed[k], v), (case, k)
                _check_against_reference(graphed, tables, ref, kjt, layout)
        raise_errors(model, wait=True)
    dist.barrier()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2])
def test_captured_forward_matches_eager_and_reference(world_size, layout):
    run_ranks(_forward, world_size, layouts=(layout,), deadline_s=DEADLINE_S)


def _many_replays(rank, world_size):
    """Replays enqueued back to back, far more than the exchanges' rings of step
    records hold, with no wait on the host: every step's record is read, and the
    outputs are right."""
    tables = make_tables(4, seed=8)
    ref, model = _sharded(world_size, tables, "tw")
    kjts = [fixed_size_kjt(tables, 6 + 5 * rank, 900 + 10 * i + rank) for i in range(4)]
    on_gpu = [k.to(GPU) for k in kjts]
    with torch.no_grad():
        step = capture(model, on_gpu[0])
        outs = [step(on_gpu[i % 4]).values().clone() for i in range(3 * RING_ENTRIES)]
        static = step(on_gpu[0])  # the KeyedTensor every call returns
    raise_errors(model, wait=True)
    for i in range(-4, 0):
        actual = dict(zip(static.keys(), outs[i].split(static.length_per_key(), dim=1)))
        _check_against_reference(actual, tables, ref, kjts[i % 4], "tw")
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_many_replays_without_waiting(world_size):
    run_ranks(_many_replays, world_size, deadline_s=DEADLINE_S)


# ------------------------------------------------------------------- (b) DLRM

DLRM_DIM = 8
DENSE_IN = 5


def _dlrm(rank, world_size, layout):
    """TorchRec's DLRM with its tables sharded by ``layout`` and dense layers on the GPU,
    and the same DLRM unsharded on the CPU (same weights)."""
    torch.cuda.set_device(GPU)
    torch.manual_seed(3)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DLRM_DIM, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate((13, 40, 7, 22))
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=CPU),
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[16, DLRM_DIM],
        over_arch_layer_sizes=[16, 1],
        dense_device=GPU,
    )
    dlrm.inter_arch.to(GPU)  # its indices are made on the CPU, copied at every step otherwise
    unsharded = copy.deepcopy(dlrm).to(CPU)
    sharder = PgasEmbeddingBagCollectionSharder(options=shared_gpu_options(world_size))
    plan = construct_module_sharding_plan(
        dlrm.sparse_arch.embedding_bag_collection,
        per_param_sharding=_placement(tables, world_size, LAYOUTS[layout]),
        world_size=world_size,
        local_size=1,
        device_type="cuda",
        sharder=sharder,
    )
    model = DistributedModelParallel(
        dlrm,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=GPU,
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    ebc = unsharded.sparse_arch.embedding_bag_collection
    load_unsharded_state_dict(model, ebc.state_dict(), prefix="sparse_arch.embedding_bag_collection.")
    return tables, model.eval(), unsharded.eval()


def _dlrm_forward(rank, world_size):
    for layout in ("tw", "rw"):
        tables, model, unsharded = _dlrm(rank, world_size, layout)
        batch_size = 14 + 9 * rank
        g = torch.Generator().manual_seed(rank)
        batches = [
            (
                torch.randn(batch_size, DENSE_IN, generator=g).to(GPU),
                fixed_size_kjt(tables, batch_size, 40 + 10 * i + rank),
            )
            for i in range(5)
        ]
        with torch.no_grad():
            dense, kjt = batches[0]
            step = capture(lambda dense, kjt: model(dense, kjt), dense, kjt.to(GPU), model=model)
            for dense, kjt in batches[1:]:
                graphed = step(dense, kjt.to(GPU)).clone()
                eager = model(dense, kjt.to(GPU))
                assert graphed.shape == (batch_size, 1)
                assert torch.equal(graphed, eager), layout
                expected = unsharded(dense.cpu(), kjt)
                torch.testing.assert_close(graphed.cpu(), expected, rtol=1e-5, atol=1e-5, msg=layout)
        raise_errors(model, wait=True)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_captured_dlrm_forward_matches_eager_and_unsharded(world_size):
    run_ranks(_dlrm_forward, world_size, deadline_s=DEADLINE_S)


# --------------------------------------------------------------- (c) training


class _Regression(nn.Module):
    """The EBC under test and a dense layer on its pooled output: a loss to train by."""

    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(11)  # the same dense weights in every model
        dims = sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs())
        self.dense = nn.Linear(dims, 1, device=GPU)

    def forward(self, kjt, target):
        pred = self.dense(self.ebc(kjt).values()).squeeze(1)
        return ((pred - target) ** 2).mean()


def _train_step(model, optimizer):
    """One training step: forward, backward (the tables' fused optimizer updates them
    in it), the dense optimizer's step."""

    def step(kjt, target):
        optimizer.zero_grad(set_to_none=False)
        loss = model(kjt, target)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _train(rank, world_size, layout, schedule=False):
    """Captured training steps against the same steps run eagerly; with ``schedule``, under
    a learning-rate schedule of the tables' fused optimizer (torch's ``LambdaLR``, stepped
    after every step), which each replay takes at its call as eager steps do (a graph
    that kept its capture's rate would drift from the eager run after the first replay)."""
    optimizers = (
        [EmbOptimType.EXACT_ROWWISE_ADAGRAD]
        if schedule
        else [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD]
    )
    for optimizer in optimizers:
        tables = make_tables(4, seed=9)
        fused = {"optimizer": optimizer, "learning_rate": 0.1, "eps": 1e-3}
        runs, schedules = {}, []
        for how in ("graphed", "eager"):
            ref, model = _sharded(world_size, tables, layout, fused=fused, wrapper=_Regression)
            dense = KeyedOptimizerWrapper(
                dict(model.module.dense.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.05)
            )
            runs[how] = (model, _train_step(model, CombinedOptimizer([model.fused_optimizer, dense])))
            if schedule:
                schedules.append(torch.optim.lr_scheduler.LambdaLR(model.fused_optimizer, lambda step: 0.5**step))
        batch_size = 18 + 5 * rank
        g = torch.Generator().manual_seed(rank)
        batches = [
            (
                fixed_size_kjt(tables, batch_size, 70 + 10 * i + rank).to(GPU),
                torch.randn(batch_size, generator=g).to(GPU),
            )
            for i in range(6)
        ]
        # The capture's warm-up trains on the first batch three times: so does the eager run.
        graphed = capture(runs["graphed"][1], *batches[0], warmup=3, model=runs["graphed"][0])
        for _ in range(3):
            runs["eager"][1](*batches[0])
        for kjt, target in batches[1:]:
            loss = graphed(kjt, target).clone()
            torch.testing.assert_close(loss, runs["eager"][1](kjt, target), rtol=1e-6, atol=1e-6)
            for s in schedules:
                s.step()
        assert all(s.get_last_lr()[0] == pytest.approx(0.1 * 0.5**5) for s in schedules)
        raise_errors(runs["graphed"][0], wait=True)
        like = ref.state_dict()
        weights = {how: gather_unsharded_state_dict(m, like, prefix="ebc.") for how, (m, _) in runs.items()}
        for name, w in weights["eager"].items():
            torch.testing.assert_close(weights["graphed"][name].cpu(), w.cpu(), rtol=1e-6, atol=1e-6, msg=name)
            assert not torch.equal(w.cpu(), like[name]), f"{name} was not trained"
        dense = {how: m.module.dense.weight.detach() for how, (m, _) in runs.items()}
        torch.testing.assert_close(dense["graphed"], dense["eager"], rtol=1e-6, atol=1e-6)
    dist.barrier()


@pytest.mark.parametrize("layout", ["tw", "rw"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_captured_training_matches_eager(world_size, layout):
    run_ranks(_train, world_size, layout=layout, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("world_size,layout", [(1, "tw"), (2, "rw")])
def test_captured_training_follows_a_learning_rate_schedule(world_size, layout):
    run_ranks(_train, world_size, layout=layout, schedule=True, deadline_s=DEADLINE_S)


# -------------------------------------------------------------- (d) bad batches


def _bad_batches(rank, world_size, layout):
    """An id out of range on the last rank, then a batch of other sizes there: every rank
    raises PgasInputError naming it (at a later call or at ``raise_errors(model,
    wait=True)``), the bad step's outputs are NaN, and the next batch is served right."""
    bad_rank = world_size - 1
    tables = make_tables(4, seed=5)
    ref, model = _sharded(world_size, tables, layout)
    batch_size = 9 + rank
    good = [fixed_size_kjt(tables, batch_size, 300 + 10 * i + rank) for i in range(5)]
    with torch.no_grad():
        step = capture(model, good[0].to(GPU))
        out = step(good[1].to(GPU))  # the static outputs: every call's
        _check_against_reference(out.to_dict(), tables, ref, good[1], layout)

        bad = good[2]
        if rank == bad_rank:
            values = bad.values().clone()
            values[0] = tables[0].num_embeddings  # feature f0's first id
            bad = KeyedJaggedTensor(keys=bad.keys(), values=values, lengths=bad.lengths())
        with pytest.raises(PgasInputError, match=f"rank {bad_rank}"):
            step(bad.to(GPU))
            raise_errors(model, wait=True)
        assert torch.isnan(out.values()).all(), out.values()
        step(good[3].to(GPU))
        _check_against_reference(out.to_dict(), tables, ref, good[3], layout)

        other = fixed_size_kjt(tables, batch_size + 1, 400 + rank)
        with pytest.raises(PgasInputError, match=f"rank {bad_rank}"):
            if rank == bad_rank:
                with pytest.raises(ValueError, match="lengths of shape"):
                    step(other.to(GPU))
            else:
                step(good[2].to(GPU))
            raise_errors(model, wait=True)
        assert torch.isnan(out.values()).all(), out.values()
        step(good[4].to(GPU))
        _check_against_reference(out.to_dict(), tables, ref, good[4], layout)
        raise_errors(model, wait=True)
    dist.barrier()


@pytest.mark.parametrize("layout", ["tw", "rw"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_captured_bad_batch_raises_everywhere_and_next_is_right(world_size, layout):
    run_ranks(_bad_batches, world_size, layout=layout, deadline_s=DEADLINE_S)


# ----------------------------------------------------------------- (e) no sync


def _no_host_sync(rank, world_size, layout):
    """Eager inference steps after the first two under ``set_sync_debug_mode("error")``:
    the host never waits for the GPU (what a capture needs). Only waits that torch
    makes are seen (NVSHMEM's and Triton's own calls are not)."""
    pooling, weighted = (PoolingType.MEAN, True) if layout == "rw" else (PoolingType.SUM, layout == "mix")
    tables = make_tables(4, seed=20, pooling=pooling)
    ref, model = _sharded(world_size, tables, layout, weighted)
    kjts = [random_kjt(tables, 10 + 3 * rank, 500 + 10 * i + rank, weighted) for i in range(6)]
    on_gpu = [k.to(GPU) for k in kjts]
    outs = []
    with torch.no_grad():
        for kjt in on_gpu[:2]:  # the first batch sets the module up (collectively)
            model(kjt).wait()
        raise_errors(model, wait=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for kjt in on_gpu[2:]:
                outs.append(model(kjt).wait())
                raise_errors(model)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    raise_errors(model, wait=True)
    for kt, kjt in zip(outs, kjts[2:]):
        _check_against_reference(kt.to_dict(), tables, ref, kjt, layout)
    dist.barrier()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2])
def test_eager_inference_steps_do_not_sync_with_the_host(world_size, layout):
    run_ranks(_no_host_sync, world_size, layout=layout, deadline_s=DEADLINE_S)


def _no_host_sync_training(rank, world_size, layout):
    """Eager training steps (forward, backward with the tables' fused update, the dense
    optimizer's step) after the first two under ``set_sync_debug_mode("error")``, with
    weights equal to the same steps run with the host allowed to wait."""
    tables = make_tables(4, seed=21)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}
    runs = {}
    for how in ("free", "checked"):
        ref, model = _sharded(world_size, tables, layout, fused=fused, wrapper=_Regression)
        runs[how] = (model, _train_step(model, torch.optim.SGD(model.module.dense.parameters(), lr=0.05)))
    g = torch.Generator().manual_seed(rank)
    batches = [
        (
            random_kjt(tables, 10 + 3 * rank, 600 + 10 * i + rank).to(GPU),
            torch.randn(10 + 3 * rank, generator=g).to(GPU),
        )
        for i in range(6)
    ]
    losses = {"free": [], "checked": []}
    for i, batch in enumerate(batches):
        losses["checked"].append(runs["checked"][1](*batch))
        raise_errors(runs["checked"][0], wait=True)
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            losses["free"].append(runs["free"][1](*batch))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    raise_errors(runs["free"][0], wait=True)
    torch.testing.assert_close(torch.stack(losses["free"]), torch.stack(losses["checked"]), rtol=1e-6, atol=1e-6)
    like = ref.state_dict()
    weights = {how: gather_unsharded_state_dict(m, like, prefix="ebc.") for how, (m, _) in runs.items()}
    for name, w in weights["checked"].items():
        torch.testing.assert_close(weights["free"][name].cpu(), w.cpu(), rtol=1e-6, atol=1e-6, msg=name)
        assert not torch.equal(w.cpu(), like[name]), f"{name} was not trained"
    dist.barrier()


@pytest.mark.parametrize("layout", ["tw", "rw"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_eager_training_steps_do_not_sync_with_the_host(world_size, layout):
    run_ranks(_no_host_sync_training, world_size, layout=layout, deadline_s=DEADLINE_S)
