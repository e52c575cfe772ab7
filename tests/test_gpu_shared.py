"""The GPU path (NVSHMEM + Triton) with every rank on one GPU: world sizes 1 and 2
through peer mappings, and 2, 3 and 4 through NVSHMEM's put path
(``PgasOptions(remote_path="put")``, the path between nodes).

NCCL refuses two ranks on one GPU, so TorchRec's own sharding cannot be the oracle
here: the process group is gloo, and the GPU model is checked against the host
transport's model (same sharding, same FBGEMM lookups on the CPU) and a float64
reference. Peer mappings between processes that share a GPU were reliable at world
size 2 and not at 3 (shared/device/README.md): larger worlds take the put path, which
stores into no peer's memory.

Skipped without a GPU and nvshmem4py. On the GPU machine:
    python3 -m pytest -q tests/test_gpu_shared.py
"""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("nvshmem.core")

from dist_utils import (  # noqa: E402
    Float64Training,
    assert_as_close_as,
    assert_close_to_reference,
    mailbox_payload,
    make_tables,
    pgas_tw,
    random_kjt,
    reference_pooled,
    run_ranks,
    shard,
    upstream_grads,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import (  # noqa: E402
    EmbeddingBagCollection,  # noqa: E402
    KeyedJaggedTensor,
    PoolingType,
)

from torchrec_pgas.graphs import raise_errors  # noqa: E402
from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder  # noqa: E402
from torchrec_pgas.sharding.tw_base import PgasInputError  # noqa: E402
from torchrec_pgas.sharding_plan import pgas_row_wise  # noqa: E402
from torchrec_pgas.testing import gather_unsharded_state_dict  # noqa: E402
from torchrec_pgas.types import PgasOptions  # noqa: E402

GPU = torch.device("cuda", 0)
#: A test whose ranks still run after this long hangs: every wait times out in 60 s.
DEADLINE_S = 240


def _placement(tables, owners, row_wise):
    """``owners[i]`` owns table i table-wise, unless its name is in ``row_wise``."""
    rw = pgas_row_wise(compute_kernel="fused")
    return {t.name: rw if t.name in row_wise else pgas_tw(o) for t, o in zip(tables, owners)}


#: The GPU model's options: peer mappings where NVSHMEM gives them (one GPU: every peer).
DIRECT = PgasOptions(timeout_s=60)
#: NVSHMEM puts to every peer, as between nodes.
PUTS = PgasOptions(timeout_s=60, remote_path="put")


def _pair(rank, world_size, tables, placement, weighted, fused=None, options=DIRECT):
    """The same sharded model on the GPU (NVSHMEM, with ``options``) and on the CPU
    (host transport)."""
    torch.cuda.set_device(GPU)
    ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(fused_params=fused, options=options)
    gpu = shard(ref, placement, world_size, sharder, device=GPU, local_size=1)
    host = shard(ref, placement, world_size, PgasEmbeddingBagCollectionSharder(fused_params=fused))
    return ref, gpu, host


#: (owners, row-wise tables, batch size per rank, pooling, weighted): a rank that owns no
#: table, mean pooling, per-sample weights, and modules mixing both PGAS types. Owners
#: are taken modulo the world size.
FORWARD_CASES = [
    ([0, 1, 0, 1], (), [64, 17, 3, 26], PoolingType.SUM, False),
    ([1, 1, 1], (), [5, 33, 20, 1], PoolingType.MEAN, False),
    ([0, 1, 1], (), [40, 40, 11, 40], PoolingType.SUM, True),
    ([0, 0, 1, 1], ("t1", "t3"), [30, 9, 14, 2], PoolingType.SUM, False),
    ([1, 0, 0], ("t0",), [12, 21, 7, 16], PoolingType.MEAN, True),
    ([3, 2, 1, 0], (), [13, 29, 6, 31], PoolingType.SUM, False),
]


def _forward(rank, world_size, options=DIRECT):
    """Every case in one process group (each start of NVSHMEM costs seconds)."""
    for case, (owners, row_wise, batch_sizes, pooling, weighted) in enumerate(FORWARD_CASES):
        owners = [o % world_size for o in owners]
        for seed in range(2):
            torch.manual_seed(seed)
            tables = make_tables(len(owners), seed, pooling)
            placement = _placement(tables, owners, row_wise)
            ref, gpu, host = _pair(rank, world_size, tables, placement, weighted, options=options)
            for step in range(4):
                kjt = random_kjt(tables, batch_sizes[rank], 1000 * seed + 10 * step + rank, weighted)
                with torch.no_grad() if step % 2 else torch.enable_grad():
                    out = gpu(kjt.to(GPU)).to_dict()
                    on_host = host(kjt).to_dict()
                assert sorted(out) == sorted(on_host), case
                for k in on_host:
                    torch.testing.assert_close(out[k].cpu(), on_host[k], rtol=1e-6, atol=1e-6, msg=f"case {case}")
                expected = reference_pooled(tables, ref.state_dict(), kjt, row_wise=row_wise)
                assert_close_to_reference(out, expected)


@pytest.mark.parametrize("world_size", [1, 2])
def test_shared_gpu_forward_matches_host_and_reference(world_size):
    run_ranks(_forward, world_size, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_gpu_put_path_forward_matches_host_and_reference(world_size):
    run_ranks(_forward, world_size, options=PUTS, deadline_s=DEADLINE_S)


#: (offset in the slot, bytes) of the pieces each rank puts into every rank's slot, to
#: itself too: 16-, 8- and 4-byte aligned ranges and odd ones, empty and long ones.
PIECES = [(0, 4096 + 16), (4112, 8), (4121, 3), (4128, 12), (4144, 0), (4145, 1), (4160, 70_001), (74_168, 8 * 1001)]
SLOT_BYTES = 82_176


def _pieces(rank, world_size, options):
    """Every rank puts ``PIECES`` of random bytes, from sources at every alignment, into
    every rank's slot (its own among them) for three steps through the transport, and
    every rank reads back what each source put."""
    from torchrec_pgas.transport import Mailbox, get_transport

    torch.cuda.set_device(GPU)
    t = get_transport(dist.group.WORLD, GPU, options)
    box = Mailbox(t, slot_bytes=SLOT_BYTES, per_source=True, name="pieces")

    def payload(step, source, dest, i, size):
        words = mailbox_payload(100 * step + i, source, dest, -(-size // 8))
        return words.view(torch.uint8)[:size].to(GPU)

    for step in range(1, 4):
        for dest in range(world_size):
            base = box.begin_send(dest, step)
            for i, (offset, size) in enumerate(PIECES):
                # The source starts at a byte offset of its own: 0, 1, 4, 8, ...
                backing = torch.empty(size + 16, dtype=torch.uint8, device=GPU)
                src = backing[[0, 1, 4, 8, 12][i % 5] :][:size]
                src.copy_(payload(step, rank, dest, i, size))
                t.put(box.buffer, dest, base + offset, src)
            box.end_send(dest, step)
        for source in range(world_size):
            box.wait(source, step)
            slot = box.slot(source, step)
            for i, (offset, size) in enumerate(PIECES):
                got = slot[offset : offset + size]
                assert torch.equal(got, payload(step, source, rank, i, size)), (step, source, i)
            box.release(source, step)
    t.check()


@pytest.mark.parametrize("world_size,options", [(1, DIRECT), (2, DIRECT), (2, PUTS), (3, PUTS)])
def test_shared_gpu_transport_puts_byte_ranges_of_any_alignment(world_size, options):
    run_ranks(_pieces, world_size, options=options, deadline_s=DEADLINE_S)


def _train(rank, world_size, owners, row_wise, batch_sizes, options=DIRECT, **batches):
    for optimizer in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD):
        _train_with(rank, world_size, owners, row_wise, batch_sizes, optimizer, options, **batches)


def _train_with(
    rank,
    world_size,
    owners,
    row_wise,
    batch_sizes,
    optimizer,
    options,
    pooling=PoolingType.SUM,
    weighted=False,
    max_len=4,
):
    tables = make_tables(len(owners), seed=7, pooling=pooling)
    torch.manual_seed(7)
    fused = {"optimizer": optimizer, "learning_rate": 0.1, "eps": 1e-3}
    placement = _placement(tables, owners, row_wise)
    ref, gpu, host = _pair(rank, world_size, tables, placement, weighted, fused, options=options)
    exact = Float64Training(tables, ref.state_dict(), optimizer, 0.1, 1e-3, row_wise)
    # The float32 results of the GPU and of FBGEMM's CPU kernels part by a few 1e-6
    # per pooled row (fused multiply-adds against products then sums), and the rows'
    # gradients, sums of many terms of both signs, by more; rowwise Adagrad divides
    # them by their own small norms. Each is judged by its distance to float64.
    floor = 1e-6 * max(1.0, max_len / 4)
    for step in range(5):
        batches = [random_kjt(tables, batch_sizes[r], 100 * step + r, weighted, max_len) for r in range(world_size)]
        outs = []
        for model, dev in ((gpu, GPU), (host, torch.device("cpu"))):
            kt = model(batches[rank].to(dev)).to_dict()
            loss = sum((kt[k] * u.to(dev)).sum() for k, u in upstream_grads(kt, step).items())
            loss.backward()
            outs.append({k: v.detach().cpu() for k, v in kt.items()})
        expected = exact.step(batches, lambda pooled: upstream_grads(pooled, step))
        assert_as_close_as(outs[0], outs[1], expected[rank], floor)
    like = ref.state_dict()
    w_gpu = gather_unsharded_state_dict(gpu, like, prefix="ebc.")
    w_host = gather_unsharded_state_dict(host, like, prefix="ebc.")
    assert_as_close_as(w_gpu, w_host, exact.weights, floor)
    for name in w_host:
        assert not torch.equal(w_host[name], like[name]), f"{name} was not trained"


@pytest.mark.parametrize("world_size", [1, 2])
def test_shared_gpu_training_matches_host(world_size):
    owners = [o % world_size for o in (0, 1, 1, 0)]
    run_ranks(_train, world_size, owners=owners, row_wise=("t2",), batch_sizes=[24, 7], deadline_s=DEADLINE_S)


#: (world size, pooling, weighted, longest bag): the fused update's gradient scales (mean
#: pooling, per-sample weights) and bags longer than ``update_keys`` takes at once.
SCALED_TRAINING = [
    (w, pooling, weighted, longest)
    for w in (1, 2)
    for pooling, weighted, longest in ((PoolingType.MEAN, False, 40), (PoolingType.SUM, True, 70))
]


@pytest.mark.parametrize("world_size,pooling,weighted,max_len", SCALED_TRAINING)
def test_shared_gpu_training_of_scaled_and_long_bags_matches_host(world_size, pooling, weighted, max_len):
    owners = [o % world_size for o in (0, 1, 1, 0)]
    run_ranks(
        _train,
        world_size,
        owners=owners,
        row_wise=("t2",),
        batch_sizes=[40, 33],
        pooling=pooling,
        weighted=weighted,
        max_len=max_len,
        deadline_s=DEADLINE_S,
    )


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_gpu_put_path_training_matches_host(world_size):
    owners = [o % world_size for o in (0, 1, 2, 3)]
    batch_sizes = [24, 7, 15, 30]
    run_ranks(
        _train,
        world_size,
        owners=owners,
        row_wise=("t2",),
        batch_sizes=batch_sizes,
        options=PUTS,
        deadline_s=DEADLINE_S,
    )


def _bad_batches(rank, world_size, grad):
    """A bad batch on the last rank raises the same error on every rank, and the next
    good batch is served right, in a module of pgas_table_wise only (the direct path)
    and one mixing pgas_table_wise and pgas_row_wise (the direct path too):
    ids out of range, a negative length whose lengths still add up, 2-D values, a
    missing key, and an error while the send is prepared (its message must reach
    every rank); under autograd (``grad``) or not. Every case runs; the failures are
    named together at the end."""
    from torchrec_pgas.sharding import tw_device_exchange

    bad_rank = world_size - 1
    failed = []
    for row_wise in ((), ("t1",)):
        tables = make_tables(3, seed=3)
        torch.manual_seed(3)
        ref, gpu, _ = _pair(rank, world_size, tables, _placement(tables, [0, 1 % world_size, 0], row_wise), False)
        n0 = tables[0].num_embeddings
        keys = ["f0", "f1", "f2"]
        bad = {
            "id out of range": KeyedJaggedTensor(
                keys=keys, values=torch.tensor([n0, 0, 0]), lengths=torch.ones(3, dtype=torch.int64)
            ),
            "negative length": KeyedJaggedTensor(keys=keys, values=torch.arange(3), lengths=torch.tensor([-1, 3, 1])),
            "2-D values": KeyedJaggedTensor(
                keys=keys, values=torch.zeros(3, 2, dtype=torch.int64), lengths=torch.ones(3, dtype=torch.int64)
            ),
            "missing key": KeyedJaggedTensor(
                keys=keys[:2], values=torch.arange(2), lengths=torch.ones(2, dtype=torch.int64)
            ),
            "failed send": None,
        }
        for i, (what, kjt_bad) in enumerate(bad.items()):
            kjt = random_kjt(tables, 9 + rank, 50 * i + rank)
            real = tw_device_exchange.send_input
            if kjt_bad is not None and rank == bad_rank:
                kjt = kjt_bad
            elif kjt_bad is None:
                calls = []

                def fails(*args, **kwargs):
                    calls.append(1)
                    if rank == bad_rank and len(calls) == 1:
                        raise RuntimeError("prepared to fail")
                    return real(*args, **kwargs)

                tw_device_exchange.send_input = fails
            match = f"rank {bad_rank}" + (".*RuntimeError: prepared to fail" if kjt_bad is None else "")
            case = f"{what}, row-wise {row_wise}"
            try:
                # Under autograd, as in inference, the device finds the bad batch: every
                # rank raises by ``raise_errors`` at the latest (the host path of the bad
                # rank, at once).
                with torch.set_grad_enabled(grad), pytest.raises(PgasInputError, match=match):
                    gpu(kjt.to(GPU)).to_dict()
                    raise_errors(gpu, wait=True)
            except BaseException as e:  # noqa: BLE001 (named with the others below)
                failed.append(f"{case}: not raised right: {e!r}"[:300])
            finally:
                tw_device_exchange.send_input = real
            nxt = random_kjt(tables, 5 + 3 * rank, 70 * i + rank)
            try:
                with torch.set_grad_enabled(grad):
                    out = gpu(nxt.to(GPU)).to_dict()
                    raise_errors(gpu, wait=True)
                expected = reference_pooled(tables, ref.state_dict(), nxt, row_wise=row_wise)
                assert_close_to_reference(out, expected)
            except BaseException as e:  # noqa: BLE001
                failed.append(f"{case}: the next batch: {e!r}"[:300])
    assert not failed, f"rank {rank}, grad {grad}:\n" + "\n".join(failed)
    dist.barrier()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_shared_gpu_bad_batch_raises_everywhere_and_next_is_right(world_size, grad):
    run_ranks(_bad_batches, world_size, grad=grad, deadline_s=DEADLINE_S)
