"""The GPU path (NVSHMEM + Triton) against TorchRec's table_wise (FBGEMM FUSED + NCCL),
the host path and a float64 reference, on real processes, one per GPU.

Skipped without two GPUs and nvshmem4py. On the GPU machine:
    python3 -m pytest -q tests/test_gpu.py
"""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)
pytest.importorskip("nvshmem.core")

from dist_utils import (  # noqa: E402
    assert_close_to_reference,
    make_tables,
    pgas_tw,
    random_kjt,
    reference_pooled,
    run_example,
    run_ranks,
    shard,
    torchrec_tw,
    tw_placement,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType  # noqa: E402

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder  # noqa: E402
from torchrec_pgas.sharding.tw_base import PgasInputError  # noqa: E402
from torchrec_pgas.testing import gather_unsharded_state_dict  # noqa: E402
from torchrec_pgas.transport import Mailbox, get_transport  # noqa: E402
from torchrec_pgas.types import PgasOptions  # noqa: E402


def _mailbox(rank, world_size, steps, n):
    dev = torch.device("cuda", rank)
    t = get_transport(dist.group.WORLD, dev, PgasOptions(timeout_s=30))
    box = Mailbox(t, slot_bytes=8 * n, per_source=True, name="gpu stream")
    for step in range(1, steps + 1):
        for dest in range(world_size):
            base = box.begin_send(dest, step)
            g = torch.Generator().manual_seed(step * 100 + rank * 10 + dest)
            t.put(box.buffer, dest, base, torch.randint(0, 2**62, (n,), generator=g).to(dev))
            box.end_send(dest, step)
        for source in range(world_size):
            box.wait(source, step)
            g = torch.Generator().manual_seed(step * 100 + source * 10 + rank)
            expected = torch.randint(0, 2**62, (n,), generator=g).to(dev)
            assert torch.equal(box.slot(source, step).view(torch.int64), expected), (step, source)
            box.release(source, step)
    t.check()


def test_nvshmem_mailbox_delivers_every_step_intact():
    run_ranks(_mailbox, 2, backend="nccl", steps=30, n=1 << 16)


def _models(rank, world_size, tables, owners, weighted, fused=None, seed=0):
    dev = torch.device("cuda", rank)
    torch.manual_seed(seed)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused, options=PgasOptions(timeout_s=60))
    pgas = shard(ref, tw_placement(tables, owners, pgas_tw), world_size, sharder, device=dev)
    tw = shard(ref, tw_placement(tables, owners, torchrec_tw), world_size, sharder, device=dev)
    return ref, pgas, tw


def _forward(rank, world_size, owners, batch_sizes, pooling, weighted):
    dev = torch.device("cuda", rank)
    gloo = dist.new_group(backend="gloo")
    for seed in range(2):
        tables = make_tables(len(owners), seed, pooling)
        ref, pgas, tw = _models(rank, world_size, tables, owners, weighted, seed=seed)
        host = shard(
            ref,
            tw_placement(tables, owners, pgas_tw),
            world_size,
            PgasEmbeddingBagCollectionSharder(),
            pg=gloo,
        )
        for step in range(4):
            kjt = random_kjt(tables, batch_sizes[rank], 1000 * seed + 10 * step + rank, weighted)
            with torch.no_grad() if step % 2 else torch.enable_grad():
                out = pgas(kjt.to(dev)).to_dict()
                expected = tw(kjt.to(dev)).to_dict()
                on_host = host(kjt).to_dict()
            for k in expected:
                assert torch.equal(out[k], expected[k]), (seed, step, k)
                assert torch.equal(out[k].cpu(), on_host[k]), (seed, step, k)
            assert_close_to_reference(out, reference_pooled(tables, ref.state_dict(), kjt))


@pytest.mark.parametrize(
    "owners,batch_sizes,pooling,weighted",
    [
        ([0, 1, 0, 1], [64, 17], PoolingType.SUM, False),
        ([1, 1, 1], [5, 33], PoolingType.MEAN, False),  # rank 0 owns no table
        ([0, 1, 1], [40, 40], PoolingType.SUM, True),
    ],
    ids=["sum", "mean-idle-rank", "weighted"],
)
def test_gpu_forward_matches_table_wise_host_and_reference(owners, batch_sizes, pooling, weighted):
    run_ranks(_forward, 2, backend="nccl", owners=owners, batch_sizes=batch_sizes, pooling=pooling, weighted=weighted)


def _inference(rank, world_size, data_types):
    """Inference pools with ``lookup_put`` (one kernel from the ids slots to the
    requesters' outputs): dims past one block of columns, sum and mean tables in
    separate lookup groups, per-sample weights, batch sizes that differ per rank."""
    from torchrec_pgas.sharding import tw_device_exchange

    dev = torch.device("cuda", rank)
    launches = []
    launch = tw_device_exchange.lookup_put
    tw_device_exchange.lookup_put = lambda *args: launches.append(launch(*args))
    dims, owners = [4, 132, 256, 64, 8], [0, 1, 1, 0, 1]
    poolings = [PoolingType.SUM, PoolingType.MEAN]
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=d,
            num_embeddings=50 + 7 * i,
            feature_names=[f"f{i}"],
            pooling=poolings[i % 2],
            data_type=data_types[i % len(data_types)],
        )
        for i, d in enumerate(dims)
    ]
    for weighted in (False, True):
        launches.clear()
        _, pgas, tw = _models(rank, world_size, tables, owners, weighted, seed=7)
        for step in range(3):
            kjt = random_kjt(tables, [70, 33][rank] + step, 10 * step + rank, weighted, max_len=30).to(dev)
            with torch.no_grad():
                out, expected = pgas(kjt).to_dict(), tw(kjt).to_dict()
            for k in expected:
                assert torch.equal(out[k], expected[k]), (weighted, step, k)
        # The kernel pooled every step, unless the tables' dtypes differ (FBGEMM then).
        assert len(launches) == (3 if len(data_types) == 1 else 0)


@pytest.mark.parametrize(
    "data_types",
    # (FBGEMM 1.6 refuses bf16 FUSED tables: "cache_precision bf16 not supported")
    [[DataType.FP32], [DataType.FP16], [DataType.FP32, DataType.FP16]],
    ids=["fp32", "fp16", "mixed-dtypes-fall-back-to-fbgemm"],
)
def test_gpu_inference_matches_table_wise_bit_for_bit(data_types):
    run_ranks(_inference, 2, backend="nccl", data_types=data_types)


def _row_wise(rank, world_size, pooling, weighted, optimizer):
    """pgas_row_wise against TorchRec's row_wise (FBGEMM FUSED, NCCL reduce-scatter) on
    the same weights: forward with and without autograd (two owners' partial sums add
    the same either way round, so bit for bit), then training steps."""
    from torchrec.distributed.sharding_plan import row_wise

    from torchrec_pgas.sharding_plan import pgas_row_wise

    dev = torch.device("cuda", rank)
    tables = make_tables(4, seed=3, pooling=pooling)
    fused = {"optimizer": optimizer, "learning_rate": 0.1, "eps": 1e-3}
    torch.manual_seed(3)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused, options=PgasOptions(timeout_s=60))
    models = [
        shard(ref, {t.name: gen(compute_kernel="fused") for t in tables}, world_size, sharder, device=dev)
        for gen in (pgas_row_wise, row_wise)
    ]
    for step in range(6):
        kjt = random_kjt(tables, [37, 20][rank] + step, 10 * step + rank, weighted, max_len=6).to(dev)
        if step % 2:
            with torch.no_grad():
                out, expected = (m(kjt).to_dict() for m in models)
            for k in expected:
                assert torch.equal(out[k], expected[k]), (step, k)
            continue
        outs = []
        for model in models:
            kt = model(kjt).to_dict()
            g = torch.Generator(device=dev).manual_seed(step)
            sum((kt[k] * torch.randn(kt[k].shape, generator=g, device=dev)).sum() for k in sorted(kt)).backward()
            outs.append({k: v.detach() for k, v in kt.items()})
        for k in outs[1]:
            assert torch.equal(outs[0][k], outs[1][k]), (step, k)
    like = {k: v.to(dev) for k, v in ref.state_dict().items()}
    w_pgas, w_rw = (gather_unsharded_state_dict(m, like, prefix="ebc.") for m in models)
    for name in w_rw:
        torch.testing.assert_close(w_pgas[name], w_rw[name], rtol=1e-6, atol=1e-6)
        assert not torch.equal(w_pgas[name], like[name]), f"{name} was not trained"


@pytest.mark.parametrize(
    "pooling,weighted,optimizer",
    [
        (PoolingType.SUM, False, EmbOptimType.EXACT_SGD),
        (PoolingType.MEAN, False, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
        (PoolingType.SUM, True, EmbOptimType.EXACT_SGD),
    ],
    ids=["sum-sgd", "mean-adagrad", "weighted-sgd"],
)
def test_gpu_row_wise_matches_torchrec_row_wise(pooling, weighted, optimizer):
    run_ranks(_row_wise, 2, backend="nccl", pooling=pooling, weighted=weighted, optimizer=optimizer)


def _train(rank, world_size, optimizer, owners):
    dev = torch.device("cuda", rank)
    batch_sizes = [48, 29]
    tables = make_tables(len(owners), seed=5)
    fused = {"optimizer": optimizer, "learning_rate": 0.1, "eps": 1e-3}
    ref, pgas, tw = _models(rank, world_size, tables, owners, False, fused=fused, seed=5)
    for step in range(5):
        kjt = random_kjt(tables, batch_sizes[rank], 100 * step + rank).to(dev)
        outs = []
        for model in (pgas, tw):
            kt = model(kjt).to_dict()
            g = torch.Generator(device=dev).manual_seed(step)
            loss = sum((kt[k] * torch.randn(kt[k].shape, generator=g, device=dev)).sum() for k in sorted(kt))
            loss.backward()
            outs.append({k: v.detach() for k, v in kt.items()})
        for k in outs[1]:
            torch.testing.assert_close(outs[0][k], outs[1][k], rtol=1e-6, atol=1e-6)
    like = {k: v.to(dev) for k, v in ref.state_dict().items()}
    w_pgas = gather_unsharded_state_dict(pgas, like, prefix="ebc.")
    w_tw = gather_unsharded_state_dict(tw, like, prefix="ebc.")
    for name in w_tw:
        torch.testing.assert_close(w_pgas[name], w_tw[name], rtol=1e-6, atol=1e-6)
        assert not torch.equal(w_pgas[name], like[name]), f"{name} was not trained"


@pytest.mark.parametrize(
    "optimizer,owners",
    [
        (EmbOptimType.EXACT_SGD, [0, 1, 1, 0, 1]),
        (EmbOptimType.EXACT_ROWWISE_ADAGRAD, [0, 1, 1, 0, 1]),
        (EmbOptimType.EXACT_SGD, [0, 0, 0]),  # rank 1 owns no table
    ],
    ids=["sgd", "adagrad", "sgd-one-owner"],
)
def test_gpu_training_matches_table_wise(optimizer, owners):
    run_ranks(_train, 2, backend="nccl", optimizer=optimizer, owners=owners)


def _bad_ids(rank, world_size):
    dev = torch.device("cuda", rank)
    tables = make_tables(3, seed=1)
    _, pgas, tw = _models(rank, world_size, tables, [0, 1, 0], False, seed=1)
    good = random_kjt(tables, 8, seed=rank).to(dev)
    assert torch.equal(pgas(good).values(), tw(good).values())
    bad = random_kjt(tables, 8, seed=rank).to(dev)
    if rank == 1:
        bad.values()[-1] = tables[2].num_embeddings
    with pytest.raises(PgasInputError, match=r"rank 1 sent id \d+ for feature 'f2' of table 't2'"):
        pgas(bad)
    assert torch.equal(pgas(good).values(), tw(good).values())


def test_gpu_bad_ids_raise_on_every_rank_and_next_batch_is_served():
    run_ranks(_bad_ids, 2, backend="nccl")


def _churn(rank, world_size):
    import gc

    dev = torch.device("cuda", rank)
    tables = make_tables(3, seed=2)
    kjt = random_kjt(tables, 16, seed=rank).to(dev)
    used = []
    for _ in range(6):
        _, pgas, tw = _models(rank, world_size, tables, [0, 1, 0], False, seed=2)
        assert torch.equal(pgas(kjt).values(), tw(kjt).values())
        del pgas, tw
        gc.collect()
        transport = get_transport(dist.group.WORLD, dev, PgasOptions(timeout_s=60))
        used.append(len(transport._live))
    # The next model's first batch frees what the last one held: the count stays flat.
    assert used[-1] == used[1], f"symmetric tensors grow as models come and go: {used}"


def test_gpu_models_that_come_and_go_leak_no_symmetric_memory():
    run_ranks(_churn, 2, backend="nccl")


def _unknown_feature(rank, world_size):
    dev = torch.device("cuda", rank)
    tables = make_tables(3, seed=4)
    _, pgas, tw = _models(rank, world_size, tables, [1, 0, 1], False, seed=4)  # permuted input
    good = random_kjt(tables, 8, seed=rank).to(dev)
    assert torch.equal(pgas(good).values(), tw(good).values())
    keys = good.keys()[:-1] + ["f_unknown"] if rank == 1 else good.keys()
    bad = KeyedJaggedTensor(keys=keys, values=good.values(), lengths=good.lengths())
    with pytest.raises(PgasInputError, match=r"rank 1 sent a KJT whose features are not the model's"):
        pgas(bad)
    assert torch.equal(pgas(good).values(), tw(good).values())


def test_gpu_unknown_feature_raises_on_every_rank_and_next_batch_is_served():
    run_ranks(_unknown_feature, 2, backend="nccl")


@pytest.mark.parametrize("ours,theirs", [("pgas_table_wise", "table_wise"), ("pgas_row_wise", "row_wise")])
def test_gpu_dlrm_example_trains_in_a_pipeline_and_serves_like_torchrec(tmp_path, ours, theirs):
    """The example on 2 GPUs: TrainPipelineSparseDist training (its evaluation runs the
    inference route, with the next batch's input dist started before each lookup), a
    checkpoint, then serving next to TorchRec's counterpart."""
    ckpt = str(tmp_path / "ckpt")
    out = run_example("train.py", "--sharding", ours, "--steps", "30", "--batch-size", "128", "--checkpoint", ckpt)
    assert f"{ours}: 30 steps on 2 x cuda" in out, out
    out = run_example(
        "infer.py", "--checkpoint", ckpt, "--shardings", f"{ours},{theirs}", "--batches", "10", "--batch-size", "128"
    )
    assert f"predictions of {ours} and {theirs}: identical" in out, out
