"""Modules of ``pgas_table_wise`` and ``pgas_row_wise`` tables on the GPU path take the
direct path (``ShardedPgasEmbeddingBagCollection``): the whole batch goes to both
shardings' exchanges in its own order, the row-wise one bucketing every feature of it
on the device (``RowBlockIds``), with no permute and split by TorchRec and no host
sync in a step. Every rank on one GPU, gloo, as in ``test_gpu_shared.py`` (world size 1
through peer mappings, 2 through NVSHMEM's put path, as ``test_gpu_graphs.py``): the
GPU model is checked against the same plan on the host transport and a float64
reference.

Skipped without a GPU and nvshmem4py. On the GPU machine:
    python3 -m pytest -q tests/test_gpu_mixed.py
"""

import dataclasses
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("nvshmem.core")

from dist_utils import (  # noqa: E402
    assert_close_to_reference,
    in_order,
    pgas_tw,
    random_kjt,
    reference_pooled,
    run_ranks,
    shard,
    shared_gpu_options,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from test_direct_multi import _long_first_bag, _raised_alike  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.distributed import embeddingbag  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from torchrec_pgas.graphs import raise_errors  # noqa: E402
from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder  # noqa: E402
from torchrec_pgas.sharding.rw_device_exchange import DeviceRwExchange  # noqa: E402
from torchrec_pgas.sharding.tw_base import PgasInputError  # noqa: E402
from torchrec_pgas.sharding.tw_device_exchange import DeviceTwExchange  # noqa: E402
from torchrec_pgas.sharding_plan import pgas_row_wise  # noqa: E402
from torchrec_pgas.testing import gather_unsharded_state_dict  # noqa: E402

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")
#: A test whose ranks still run after this long hangs: every wait times out in 60 s.
DEADLINE_S = 240

#: (name, rows, dim, features, pooling, "rw" or the table-wise owner modulo the world
#: size): mean and sum tables of both types, a row-wise table pooling two features.
TABLES = [
    ("t0", 37, 8, ["f0"], PoolingType.MEAN, "rw"),
    ("t1", 21, 4, ["f1"], PoolingType.SUM, 1),
    ("t2", 50, 12, ["f2", "g"], PoolingType.SUM, "rw"),
    ("t3", 9, 16, ["f3"], PoolingType.MEAN, 0),
    ("t4", 64, 4, ["f4"], PoolingType.MEAN, "rw"),
    ("t5", 13, 8, ["f5"], PoolingType.SUM, 1),
]
ROW_WISE = [name for name, *_, kind in TABLES if kind == "rw"]
#: Batch orders, the same on every rank: the module's, and one that scatters the
#: row-wise features among the table-wise ones, out of their order.
ORDERS = {
    "module": [f for _, _, _, features, _, _ in TABLES for f in features],
    "scattered": ["f3", "f4", "f1", "g", "f5", "f0", "f2"],
}


def _tables() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=dim, feature_names=fs, pooling=pooling)
        for n, rows, dim, fs, pooling, _ in TABLES
    ]


class _TorchRecInputDists:
    """Counts the calls of TorchRec's input dist (the permute and split the direct path
    does without) in this process."""

    def __init__(self) -> None:
        self.calls = 0
        original = embeddingbag.ShardedEmbeddingBagCollection.input_dist

        def counting(module, ctx, features):
            self.calls += 1
            return original(module, ctx, features)

        embeddingbag.ShardedEmbeddingBagCollection.input_dist = counting


def _pair(world_size: int, weighted: bool, fused=None, options=None):
    """The unsharded module and the same plan on the GPU (NVSHMEM, ``options`` or
    ``shared_gpu_options``) and on the CPU (host transport)."""
    torch.cuda.set_device(GPU)
    tables = _tables()
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=CPU)
    rw = pgas_row_wise(compute_kernel="fused")
    placement = {n: rw if kind == "rw" else pgas_tw(kind % world_size) for n, *_, kind in TABLES}
    options = options or shared_gpu_options(world_size)
    gpu_sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused, options=options)
    gpu = shard(ref, placement, world_size, gpu_sharder, device=GPU, local_size=1)
    host = shard(ref, placement, world_size, PgasEmbeddingBagCollectionSharder(fused_params=fused))
    return tables, ref, gpu, host


def _assert_direct(model, keys: List[str]) -> None:
    """Both shardings' GPU exchanges take the batch as it is; the row-wise one routes
    its features where the batch has them."""
    ebc = model.module.ebc
    assert ebc._pgas_direct is True
    exchanges = ebc._pgas_exchanges
    assert sorted(type(x).__name__ for x in exchanges) == ["DeviceRwExchange", "DeviceTwExchange"]
    for x in exchanges:
        assert isinstance(x, (DeviceRwExchange, DeviceTwExchange))
        assert x._input_keys == keys
        if isinstance(x, DeviceRwExchange):
            own = [keys.index(f) for n, _, _, fs, _, kind in TABLES if kind == "rw" for f in fs]
            assert sorted(x._input_pos) == sorted(own)
            assert x._routing.routed_features(0, x._input_pos) == list(x._input_pos)


# ------------------------------------------------------------------- forward


def _forward(rank: int, world_size: int, weighted: bool) -> None:
    counter = _TorchRecInputDists()
    for order, keys in ORDERS.items():
        tables, ref, gpu, host = _pair(world_size, weighted)
        calls = counter.calls
        for step in range(4):
            batch_size = [9, 4][rank] + 3 * step  # uneven, fresh; empty bags in them
            kjt = in_order(random_kjt(tables, batch_size, 100 * step + rank, weighted), keys)
            with torch.no_grad() if step % 2 else torch.enable_grad():
                out = {k: v.detach() for k, v in gpu(kjt.to(GPU)).to_dict().items()}
                on_host = host(kjt).to_dict()
            assert sorted(out) == sorted(on_host)
            for k in on_host:
                torch.testing.assert_close(out[k].cpu(), on_host[k].detach(), rtol=1e-6, atol=1e-6, msg=(order, k))
            assert_close_to_reference(out, reference_pooled(tables, ref.state_dict(), kjt, ROW_WISE))
        raise_errors(gpu, wait=True)
        _assert_direct(gpu, keys)
        # Neither model's steps went TorchRec's way (its input dist would count them).
        assert counter.calls == calls, f"{order}: TorchRec's input dist was called"
    dist.barrier()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_mixed_module_forward_on_the_direct_path(world_size, weighted):
    run_ranks(_forward, world_size, weighted=weighted, deadline_s=DEADLINE_S)


# ----------------------------------------------------------------- training


def _train(rank: int, world_size: int) -> None:
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}
    tables, ref, gpu, host = _pair(world_size, False, fused)
    keys = ORDERS["scattered"]
    for step in range(4):
        _step_matches_host(gpu, host, in_order(random_kjt(tables, [12, 5][rank], 300 + 10 * step + rank), keys), step)
    _assert_direct(gpu, keys)
    _trained_like_host(ref, gpu, host)
    dist.barrier()


def _step_matches_host(gpu: nn.Module, host: nn.Module, kjt: KeyedJaggedTensor, step: int, train: bool = True) -> None:
    """One step of ``kjt`` on both models (in training, a backward of a random
    gradient seeded by ``step``): their outputs agree to fp32 rounding."""
    outs = []
    for model, dev in ((gpu, GPU), (host, CPU)):
        with torch.set_grad_enabled(train):
            kt = model(kjt.to(dev)).to_dict()
            if train:
                g = torch.Generator().manual_seed(step)
                sum((kt[k] * torch.randn(kt[k].shape, generator=g).to(dev)).sum() for k in sorted(kt)).backward()
        outs.append({k: v.detach().cpu() for k, v in kt.items()})
    for k in outs[1]:
        torch.testing.assert_close(outs[0][k], outs[1][k], rtol=1e-6, atol=1e-6, msg=(step, k))


def _trained_like_host(ref: nn.Module, gpu: nn.Module, host: nn.Module) -> None:
    """Both models' trained weights agree to fp32 rounding, and training moved them."""
    like = ref.state_dict()
    w_gpu = gather_unsharded_state_dict(gpu, like, prefix="ebc.")
    w_host = gather_unsharded_state_dict(host, like, prefix="ebc.")
    for name in w_host:
        torch.testing.assert_close(w_gpu[name].cpu(), w_host[name], rtol=1e-6, atol=1e-6)
        assert not torch.equal(w_host[name], like[name]), f"{name} was not trained"


@pytest.mark.parametrize("world_size", [1, 2])
def test_mixed_module_training_matches_host(world_size):
    run_ranks(_train, world_size, deadline_s=DEADLINE_S)


# ---------------------------------------------- one sharding raising in mid-step


def _second_sharding_raises(rank: int, world_size: int) -> None:
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}
    # FBGEMM's backward: a training step is checked at each sharding's output.
    options = dataclasses.replace(shared_gpu_options(world_size), sparse_update="fbgemm")
    tables, ref, gpu, host = _pair(world_size, False, fused, options)
    ebc = gpu.module.ebc
    keys = ORDERS["scattered"]

    def good(step: int, train: bool = True) -> None:
        # The oracle, the same plan on the host transport, never sees the bad batch.
        kjt = in_order(random_kjt(tables, [12, 5][rank] + step, 700 + 10 * step + rank), keys)
        _step_matches_host(gpu, host, kjt, step, train)

    good(0)
    good(1)
    names, second = ebc._sharding_types, ebc._pgas_exchanges[1]
    bad_rank = world_size - 1
    bad = in_order(random_kjt(tables, 3, 900 + rank), keys)
    if rank == bad_rank:  # over the second sharding's capacity only
        feature = ebc._embedding_shardings[1].feature_names()[0]
        bad = _long_first_bag(bad, feature, second._layout.ids_capacity + 1)
    message = rf"^{names[1]} step \d+: rank {bad_rank}'s batch .* is over capacity"
    with torch.enable_grad(), pytest.raises(PgasInputError, match=message) as info:
        gpu(bad.to(GPU))
    assert names[0] not in str(info.value)
    _raised_alike(str(info.value), ebc, world_size)
    good(2, train=False)
    good(3)
    good(4)
    raise_errors(gpu, wait=True)
    _assert_direct(gpu, keys)
    _trained_like_host(ref, gpu, host)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_mixed_module_second_sharding_raising_in_mid_step_leaves_it_in_step(world_size):
    """A training step whose batch is over the second sharding's capacity on the last
    rank: with FBGEMM's backward each sharding's output checks the step, so the second
    raises after the first has exchanged its output. Every rank raises the same error
    naming the sharding and the problem, every sharding has taken as many steps as the
    other, and the next steps, forward and training, equal the same plan on the host
    transport, which never saw the bad batch (as ``test_direct_multi``'s test of the
    host transport, where the receive raises)."""
    run_ranks(_second_sharding_raises, world_size, deadline_s=DEADLINE_S)


# ------------------------------------------------------------------- no sync


def _no_host_sync(rank: int, world_size: int) -> None:
    """Eager no-grad steps after the first two under ``set_sync_debug_mode("error")``:
    the host never waits for the GPU. Only waits that torch makes are seen (NVSHMEM's
    and Triton's own calls are not)."""
    tables, ref, gpu, _ = _pair(world_size, True)
    keys = ORDERS["scattered"]
    kjts = [in_order(random_kjt(tables, [10, 7][rank] + i, 500 + 10 * i + rank, True), keys) for i in range(6)]
    on_gpu = [k.to(GPU) for k in kjts]
    outs: List[Dict[str, torch.Tensor]] = []
    with torch.no_grad():
        for kjt in on_gpu[:2]:  # the first batch sets the module up (collectively)
            gpu(kjt).wait()
        raise_errors(gpu, wait=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for kjt in on_gpu[2:]:
                kt = gpu(kjt).wait()
                raise_errors(gpu)
                outs.append(kt)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    raise_errors(gpu, wait=True)
    _assert_direct(gpu, keys)
    for kt, kjt in zip(outs, kjts[2:]):
        assert_close_to_reference(kt.to_dict(), reference_pooled(tables, ref.state_dict(), kjt, ROW_WISE))
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_mixed_module_eager_steps_do_not_sync_with_the_host(world_size):
    run_ranks(_no_host_sync, world_size, deadline_s=DEADLINE_S)
