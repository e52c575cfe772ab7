"""Quantized tables (INT8, INT4, FP16) served on GPUs, one process per GPU rank, by
``torchrec_pgas.quant.shard_quant_model`` through the GPU exchanges, against the
unsharded quantized module on the same GPU (FBGEMM's int-N kernel): table-wise
tables equal it bit for bit, row-wise ones within fp32 rounding (the measured
difference is printed). Every rank shares one GPU, as in ``test_gpu_shared.py``: a
gloo process group, peer mappings at world size 1 and NVSHMEM puts
(``PgasOptions(remote_path="put")``) at world sizes 2 to 4.

Skipped without a GPU and nvshmem4py. On the GPU machine:
    python3 -m pytest -q tests/test_gpu_quant.py
"""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("nvshmem.core")

from dist_utils import in_order, make_tables, random_kjt, run_ranks, shared_gpu_options  # noqa: E402
from test_gpu_graphs import fixed_size_kjt  # noqa: E402
from test_quant import DTYPES, RW_ATOL, RW_RTOL, _Model  # noqa: E402
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor, PoolingType  # noqa: E402
from torchrec.inference.modules import quantize_embeddings  # noqa: E402

from torchrec_pgas.graphs import capture, raise_errors  # noqa: E402
from torchrec_pgas.quant import PgasQuantEmbeddingBagCollection, shard_quant_model  # noqa: E402
from torchrec_pgas.sharding.tw_base import PgasInputError  # noqa: E402

GPU = torch.device("cuda", 0)
#: A test whose ranks still run after this long hangs: every wait times out in 60 s.
DEADLINE_S = 300


def _quantized(tables, dtype, weighted, seed):
    """The same quantized module on the GPU in every rank and call: float tables made
    on the CPU from ``seed``, moved to the GPU, quantized there by TorchRec."""
    torch.cuda.set_device(GPU)
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu")).to(GPU)
    quant = quantize_embeddings(_Model(ebc), dtype=DTYPES[dtype], inplace=True).ebc
    assert quant.device.type == "cuda"
    return quant


def _served(tables, dtype, weighted, seed, owners, world_size):
    """The unsharded quantized module and the model serving a copy of it by
    ``owners`` (table name -> rank or "pgas_row_wise") on the GPU."""
    ref = _quantized(tables, dtype, weighted, seed)
    model = shard_quant_model(
        _Model(_quantized(tables, dtype, weighted, seed)),
        dist.group.WORLD,
        owners=owners,
        options=shared_gpu_options(world_size),
    )
    assert isinstance(model.ebc, PgasQuantEmbeddingBagCollection)
    return ref, model


# ----------------------------------------------------------------- (a) forward

#: (owners, pooling, weighted, batch size per rank at the first step): owners modulo the
#: world size; (1, 1, 1) leaves rank 0 (and ranks past 1) without a table; "rw" tables
#: are served pgas_row_wise. Later steps serve smaller, uneven batches.
CASES = [
    ((0, 1, 1, 0, 1), PoolingType.SUM, False, [40, 23, 31, 17]),
    ((1, 1, 1), PoolingType.SUM, True, [12, 30, 9, 26]),
    ((0, 2, 1, 3), PoolingType.MEAN, False, [25, 25, 8, 33]),
    ((0, "rw", 1, "rw"), PoolingType.SUM, True, [19, 36, 14, 22]),
    (("rw", 1, "rw"), PoolingType.MEAN, False, [28, 11, 35, 20]),
]


def _tables(owners, seed, pooling=PoolingType.SUM):
    """Tables of uneven sizes and dims, one per entry of ``owners``; the row-wise ones
    (``"rw"``) of 37 rows and more, uneven row blocks that leave no rank of a world
    of 2 to 4 without rows."""
    tables = make_tables(len(owners), seed, pooling)
    for i, (t, o) in enumerate(zip(tables, owners)):
        if o == "rw":
            t.num_embeddings = 37 + 2 * i
    return tables


def _owners(tables, owners, world_size):
    return {t.name: "pgas_row_wise" if o == "rw" else o % world_size for t, o in zip(tables, owners)}


def _forward(rank, world_size, dtypes):
    for dtype in dtypes:
        for case, (owners, pooling, weighted, sizes) in enumerate(CASES):
            for seed in range(2):
                tables = _tables(owners, 10 * case + seed, pooling)
                placed = _owners(tables, owners, world_size)
                ref, model = _served(tables, dtype, weighted, seed, placed, world_size)
                tw_cols = torch.cat(
                    [
                        torch.full((t.embedding_dim,), placed[t.name] != "pgas_row_wise", dtype=torch.bool)
                        for t in tables
                    ]
                ).to(GPU)
                worst = 0.0
                for step in range(4):
                    # The first batch sizes the buffers: later ones are smaller, uneven.
                    batch = sizes[rank] if step == 0 else 1 + (sizes[rank] * step) % 13 + rank
                    kjt = random_kjt(tables, batch, 1000 * seed + 10 * step + rank, weighted).to(GPU)
                    out, expected = model(kjt), ref(kjt)
                    assert out.keys() == expected.keys() and out.length_per_key() == expected.length_per_key()
                    assert out.values().dtype == expected.values().dtype, (dtype, case)
                    got, want = out.values(), expected.values()
                    assert torch.equal(got[:, tw_cols], want[:, tw_cols]), (dtype, case, seed, step)
                    torch.testing.assert_close(got, want, rtol=RW_RTOL, atol=RW_ATOL)
                    worst = max(worst, float((got - want).abs().max()))
                raise_errors(model, wait=True)
                if not tw_cols.all():
                    print(f"rank {rank} {dtype} case {case}: row-wise max abs difference {worst:.3g}")
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gpu_quant_equals_unsharded(world_size):
    """INT8, INT4, FP16 tables served table-wise (bit for bit) and row-wise, sum and
    mean pooling, weighted, a rank owning no table, uneven batches with empty bags
    (every dtype in one process group: each start of NVSHMEM costs seconds)."""
    run_ranks(_forward, world_size, dtypes=sorted(DTYPES), deadline_s=2 * DEADLINE_S)


def _empty_batch(rank, world_size):
    """A rank with no sample at a later step: its output is empty, the others' right."""
    tables = _tables((0, "rw", 1), seed=4)
    ref, model = _served(tables, "int8", False, 4, _owners(tables, (0, "rw", 1), world_size), world_size)
    for step, batch in enumerate([16, 0 if rank == world_size - 1 else 5 + rank, 7]):
        kjt = random_kjt(tables, batch, 40 + 10 * step + rank).to(GPU)
        out, expected = model(kjt).values(), ref(kjt).values()
        assert out.shape == expected.shape, step
        torch.testing.assert_close(out, expected, rtol=RW_RTOL, atol=RW_ATOL)
    raise_errors(model, wait=True)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_gpu_quant_empty_batch(world_size):
    run_ranks(_empty_batch, world_size, deadline_s=DEADLINE_S)


# -------------------------------------------------------------- (b) bad batches


def _bad_batches(rank, world_size, owners, weighted):
    """A bad batch on the last rank (an id one past its table's rows, a missing key,
    missing per-sample weights): its output is NaN, every rank raises the same
    PgasInputError naming it (at a later forward or at ``raise_errors(model,
    wait=True)``), and the next batch is served right."""
    bad_rank = world_size - 1
    tables = _tables(owners, seed=6)
    ref, model = _served(tables, "int8", weighted, 6, _owners(tables, owners, world_size), world_size)
    last = tables[-1]
    model(random_kjt(tables, 20, 600 + rank, weighted).to(GPU))  # sets the exchanges up
    cases = {
        "id out of range": (
            rf"rank {bad_rank} sent id {last.num_embeddings} for feature 'f{len(tables) - 1}' of table "
            rf"'{last.name}', which has {last.num_embeddings} rows"
        ),
        "missing key": rf"rank {bad_rank} sent a KJT whose features are not the model's",
    }
    if weighted:
        cases["no weights"] = rf"rank {bad_rank} sent a KJT with no per-sample weights, for weighted tables"
    for i, (what, match) in enumerate(cases.items()):
        kjt = random_kjt(tables, 6 + rank, 610 + 10 * i + rank, weighted)
        if rank == bad_rank and what == "id out of range":
            values = kjt.values().clone()
            values[-1] = last.num_embeddings  # the last feature's last id, one past its rows
            kjt = KeyedJaggedTensor(
                keys=kjt.keys(), values=values, lengths=kjt.lengths(), weights=kjt.weights_or_none()
            )
        elif rank == bad_rank and what == "missing key":
            kjt = random_kjt(tables[:-1], 6 + rank, 610 + 10 * i + rank, weighted)
        elif rank == bad_rank:
            kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())
        with pytest.raises(PgasInputError, match=match):
            out = model(kjt.to(GPU)).values()
            raise_errors(model, wait=True)
        assert torch.isnan(out).all(), (what, out)
        for step in range(2):
            nxt = random_kjt(tables, 3 + 4 * rank + step, 700 + 10 * i + step + rank, weighted).to(GPU)
            got, want = model(nxt).values(), ref(nxt).values()
            torch.testing.assert_close(got, want, rtol=RW_RTOL, atol=RW_ATOL, msg=what)
        raise_errors(model, wait=True)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize(
    "owners,weighted", [((0, 1, 1), False), ((1, "rw", 0), True)], ids=["table_wise", "with_row_wise"]
)
def test_gpu_quant_bad_batch_raises_everywhere_and_next_is_right(world_size, owners, weighted):
    run_ranks(_bad_batches, world_size, owners=owners, weighted=weighted, deadline_s=DEADLINE_S)


# ------------------------------------------------------- (c) graphs and no sync


def _graphed(rank, world_size, owners, dtype):
    """A serving step captured by ``torchrec_pgas.graphs.capture`` and replayed for new
    batches equals the eager step exactly, and the unsharded module (table-wise: bit
    for bit); eager steps after the first never synchronize with the host."""
    tables = _tables(owners, seed=8)
    ref, model = _served(tables, dtype, False, 8, _owners(tables, owners, world_size), world_size)
    batch_size = 11 + 4 * rank
    batches = [fixed_size_kjt(tables, batch_size, 800 + 10 * i + rank).to(GPU) for i in range(5)]
    exact = "rw" not in owners
    with torch.no_grad():
        step = capture(model, batches[0])
        for kjt in batches[1:]:
            graphed = step(kjt).values().clone()
            eager = model(kjt).values()
            assert torch.equal(graphed, eager)
            want = ref(kjt).values()
            if exact:
                assert torch.equal(graphed, want)
            else:
                torch.testing.assert_close(graphed, want, rtol=RW_RTOL, atol=RW_ATOL)
        raise_errors(model, wait=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = []
            for kjt in batches[1:]:
                outs.append(model(kjt).values())
                raise_errors(model)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    raise_errors(model, wait=True)
    for out, kjt in zip(outs, batches[1:]):
        torch.testing.assert_close(out, ref(kjt).values(), rtol=RW_RTOL, atol=RW_ATOL)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    "owners,dtype", [((0, 1, 1, 0), "int8"), ((1, "rw", 0), "int4")], ids=["table_wise", "with_row_wise"]
)
def test_gpu_quant_captured_step_matches_eager(world_size, owners, dtype):
    run_ranks(_graphed, world_size, owners=owners, dtype=dtype, deadline_s=DEADLINE_S)


# ---------------------------------------------------------- (d) a world of one


def _one_gpu(rank, world_size):
    """On a world of one GPU, table-wise tables in one FBGEMM module are served with
    no exchange (``torchrec_pgas.quant.local``): every dtype, sum and mean pooling,
    weighted, empty bags and an empty batch equal the unsharded module bit for bit
    (int32 ids and offsets, as TorchRec hands FBGEMM); each kind of bad batch has a
    NaN output and raises ``PgasInputError`` naming it, and the next batch is right;
    a first batch in another feature order is served by the exchange instead."""
    for dtype in sorted(DTYPES):
        for pooling, weighted, seed in [
            (PoolingType.SUM, False, 0),
            (PoolingType.MEAN, False, 1),
            (PoolingType.SUM, True, 2),
        ]:
            tables = _tables((0, 0, 0, 0), 30 + seed, pooling)
            ref, model = _served(tables, dtype, weighted, seed, _owners(tables, (0, 0, 0, 0), 1), 1)
            for step, batch in enumerate([24, 7, 0, 13]):
                kjt = random_kjt(tables, batch, 900 + 10 * seed + step, weighted).to(GPU)
                out, want = model(kjt).values(), ref(kjt).values()
                assert model.ebc._use_local, "a world of one serves without an exchange"
                assert out.shape == want.shape and torch.equal(out, want), (dtype, pooling, weighted, step)
            raise_errors(model, wait=True)
    tables = _tables((0, 0, 0), 40)
    ref, model = _served(tables, "int8", True, 3, _owners(tables, (0, 0, 0), 1), 1)
    model(random_kjt(tables, 10, 950, True).to(GPU))
    last = tables[-1]
    good = random_kjt(tables, 9, 951, True)
    lengths, values = good.lengths().clone(), good.values().clone()
    negative = lengths.clone()
    negative[9 + 4] = -1  # in the second feature
    values_past = values.clone()
    values_past[-1] = last.num_embeddings
    bad = {
        rf"sent id {last.num_embeddings} for feature 'f2' of table '{last.name}', which has": (values_past, lengths),
        r"whose lengths and values disagree \(negative length in feature 'f1'\)": (values, negative),
        r"whose lengths and values disagree$": (values[:-1], lengths),
    }
    for i, (match, (v, ln)) in enumerate(bad.items()):
        kjt = KeyedJaggedTensor(keys=good.keys(), values=v, lengths=ln, weights=torch.rand(v.numel())).to(GPU)
        with pytest.raises(PgasInputError, match=match):
            out = model(kjt).values()
            raise_errors(model, wait=True)
        assert out.shape[0] == 9 and torch.isnan(out).all(), match
        nxt = random_kjt(tables, 5 + i, 960 + i, True).to(GPU)
        assert torch.equal(model(nxt).values(), ref(nxt).values()), match
    raise_errors(model, wait=True)
    # A first batch in another order than the lookup's goes through the exchange.
    ref, model = _served(tables, "int8", False, 4, _owners(tables, (0, 0, 0), 1), 1)
    for step in range(3):
        kjt = random_kjt(tables, 6 + step, 970 + step)
        kjt = in_order(kjt, list(reversed(kjt.keys()))).to(GPU)
        assert torch.equal(model(kjt).values(), ref(kjt).values())
    assert model.ebc._use_local is False
    raise_errors(model, wait=True)


def test_gpu_quant_world_of_one_serves_without_an_exchange():
    run_ranks(_one_gpu, 1, deadline_s=DEADLINE_S)
