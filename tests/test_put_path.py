"""The host side of the NVSHMEM put path on CPU: ``PgasOptions.remote_path``, which
peers the transport serves by puts, the reachability probe of peers without a peer
mapping, and the put-path tables the exchange hands its four launches.

NVSHMEM is an nvshmem4py stand-in on CPU tensors (real processes, gloo), whose peer
mappings are distinct fake addresses; the kernels are recorders. What the kernels do
with the tables is the GPU tests' business (tests/test_gpu_shared.py).
"""

import sys
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from torchrec_pgas.kernels import grads_put, output_take, rows_put
from torchrec_pgas.kernels.output_take import RECORD_WORDS
from torchrec_pgas.transport import PgasTransportUnavailableError
from torchrec_pgas.types import PgasOptions

#: Where the stand-in maps peer ``q``'s copy of a symmetric tensor: far from any real
#: address, so a table entry tells which peer (and offset) it came from.
_FAKE_PEER = 1 << 44


def test_remote_path_takes_auto_or_put_only():
    assert PgasOptions().remote_path == "auto"
    assert PgasOptions(remote_path="put").remote_path == "put"
    with pytest.raises(ValueError, match=r"remote_path must be one of \['auto', 'put'\], got 'puts'"):
        PgasOptions(remote_path="puts")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sparse_update must be one of \['fused', 'fbgemm'\], got 'FBGEMM'"):
        PgasOptions(sparse_update="FBGEMM")  # type: ignore[arg-type]
    for headroom in (0.5, 0, -1, True, "2", float("inf"), float("nan"), 1e300):
        with pytest.raises(ValueError, match=r"headroom must be a number from 1 to 1024"):
            PgasOptions(headroom=headroom)  # type: ignore[arg-type]
    for size in (0, -5, True, 2.5, 10**12):
        with pytest.raises(ValueError, match=r"max_batch_size must be None or an int from 1 to"):
            PgasOptions(max_batch_size=size)  # type: ignore[arg-type]
    for timeout in (0, -1, float("nan"), float("inf"), "5", None):
        with pytest.raises(ValueError, match=r"timeout_s must be a positive number of seconds"):
            PgasOptions(timeout_s=timeout)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"transport must be one of \['auto', 'host', 'nvshmem'\], got 'bogus'"):
        PgasOptions(transport="bogus")  # type: ignore[arg-type]
    assert PgasOptions(headroom=np.float64(1.5), max_batch_size=np.int64(300)).max_batch_size == 300


def _fake_nvshmem(rank, unmapped, arrives=True):
    """Installs the stand-in: this rank has no peer mapping to the ranks in
    ``unmapped``; the probe's signals arrive if ``arrives``. Returns the kernels' calls."""
    import numpy as np

    import torchrec_pgas.kernels.put_signal as put_signal_module
    import torchrec_pgas.kernels.signal_wait as signal_wait_module
    import torchrec_pgas.transport.device_buffers as device_buffers
    import torchrec_pgas.transport.nvshmem as transport

    fake = types.ModuleType("nvshmem.core")
    fake.NvshmemKernelObject = object
    fake.get_unique_id = lambda empty: types.SimpleNamespace(_data=np.zeros(128, dtype=np.int8))
    fake.init = lambda **kwargs: None
    fake.finalize = lambda: None
    fake.free_tensor = lambda t: None
    fake.tensor = lambda shape, dtype: torch.zeros(shape, dtype=dtype)

    def get_peer_tensor(t, pe):
        if pe == rank:
            return t
        if pe in unmapped:
            return None
        return types.SimpleNamespace(data_ptr=lambda: (pe + 1) * _FAKE_PEER + t.data_ptr() % _FAKE_PEER)

    fake.get_peer_tensor = get_peer_tensor
    sys.modules["nvshmem"] = types.ModuleType("nvshmem")
    sys.modules["nvshmem.core"] = fake
    transport._cuda_core_device = lambda index: None
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None

    calls = []

    def put_signal(peers, chunks, *args, **kwargs):
        calls.append(("put_signal", peers.tolist()))

    def signal_wait(sig, peers, step, *args, per_step=1, tick=False):
        calls.append(("signal_wait", peers.tolist()))
        if arrives:
            sig[peers.long()] = (int(step.word[0]) + step.add) * per_step

    put_signal_module.put_signal = put_signal
    signal_wait_module.signal_wait = signal_wait
    device_buffers.put_signal = put_signal
    device_buffers.signal_wait = signal_wait
    return calls


def _transport(remote_path):
    from torchrec_pgas.transport.nvshmem import NvshmemTransport

    t = NvshmemTransport(dist.group.WORLD, torch.device("cuda", 0), timeout_s=5, remote_path=remote_path)
    t.device = torch.device("cpu")  # what the exchange allocates on; the stand-in is on CPU
    return t


def _fake_address(q, local):
    return (q + 1) * _FAKE_PEER + local % _FAKE_PEER


def _exchange(transport, world, dims, capacity=None):
    """A table-wise ``DeviceTwExchange`` whose rank ``r`` owns one table of ``dims[r]``
    columns (none if 0), set up for a first batch of 5 samples (slots sized by
    ``capacity``, default twice the batch)."""
    from torchrec_pgas.kernels.ids_slot import Capacity
    from torchrec_pgas.sharding.tw_base import TwFeature
    from torchrec_pgas.sharding.tw_device_exchange import DeviceTwExchange

    features = [[TwFeature(f"f{r}", f"t{r}", 10)] if dims[r] else [] for r in range(world)]
    me = transport.rank
    exchange = DeviceTwExchange(
        transport,
        group_sizes=[1] if dims[me] else [],
        weighted=False,
        lookup_reads_only_bags=True,
        fused_lookup=False,
        features_per_rank=features,
        dim_sum_per_rank=dims,
        out_dtype=torch.float32,
        capacity=capacity or Capacity(2.0),
        name="pgas_table_wise",
    )
    features_total = sum(1 for f in features if f)
    exchange._allocate(5, torch.arange(0, 5 * features_total + 1) * 2)
    return exchange


def _tables_and_launches(rank, world_size, remote_path, unmapped_by_rank):
    """Checks every table entry against where the stand-in put each symmetric tensor,
    and what reaches the launches of a step."""
    from torchrec_pgas.sharding import tw_device_exchange
    from torchrec_pgas.sharding.device_batch import DeviceRoute

    unmapped = unmapped_by_rank.get(rank, [])
    calls = _fake_nvshmem(rank, unmapped)
    t = _transport(remote_path)
    # The probe: this rank signals the ranks it has no mapping to, and waits for the
    # ranks that have none to it.
    to_me = [q for q, theirs in unmapped_by_rank.items() if rank in theirs]
    expected_probe = ([("put_signal", unmapped)] if unmapped else []) + (
        [("signal_wait", to_me)] if unmapped or to_me else []
    )
    assert calls == expected_probe, calls
    direct = [q == rank or (remote_path == "auto" and q not in unmapped) for q in range(world_size)]
    assert t.direct == direct
    put = not all(direct)
    assert t.puts_anywhere == (bool(unmapped_by_rank) or remote_path == "put")

    dims = [8, 0, 12][:world_size] + [4] * (world_size - 3)
    exchange = _exchange(t, world_size, dims)
    b, p = exchange._buffers, exchange._peers
    assert b.put_path == p.put_path == put
    assert (b.out_staging is not None) == t.puts_anywhere == (b.grad_staging is not None)
    rows, elem, me = b.sizes.rows, 4, rank
    owners = [o for o in range(world_size) if dims[o]]

    def mapped(q, local, offset):
        if q == me:
            return local + offset
        return _fake_address(q, local) + offset if direct[q] else 0

    out, count = b.out.local.data_ptr(), b.out_count.local.data_ptr()
    for g, table in enumerate(p.out_addrs):
        at = g * b.out_slot_bytes  # table-wise: one block; the kernel adds the column
        first = [mapped(q, out, at) for q in range(world_size)]
        if not put:
            assert table.shape == (world_size,) and table.tolist() == first
            continue
        assert table.shape == (rows_put.PUT_ROWS, world_size) and table.is_contiguous()
        staging = b.out_staging.data_ptr()
        assert table.tolist() == [
            first,
            list(range(world_size)),
            [out + at] * world_size,
            [count + 8 * me] * world_size,
            [staging + q * b.out_staging_bytes for q in range(world_size)],
        ]
        assert b.out_staging_bytes % 16 == 0 and b.out_staging_bytes >= rows * sum(dims) * elem
    assert p.my_counts.tolist() == [mapped(q, count, 8 * me) for q in range(world_size)]

    for words, sig, whose in (
        (p.out_free_words, b.out_free.data_ptr(), owners),
        (p.ids_free_words, b.ids_free.data_ptr(), list(range(world_size))),
    ):
        first = [mapped(q, sig, 8 * me) for q in whose]
        if put:
            assert words.shape == (output_take.PUT_ROWS, len(whose))
            assert words.tolist() == [first, whose, [sig + 8 * me] * len(whose)]
        else:
            assert words.tolist() == first

    grads, gcount = b.grads.local.data_ptr(), b.grads_count.local.data_ptr()
    dests = p.grad_dests.tolist()
    assert p.grad_dests.shape == (len(owners), grads_put.PUT_DEST_WORDS if put else 5)
    for row, o in zip(dests, owners):
        at = me * rows * dims[o] * elem
        assert row[:5] == [o, sum(dims[:o]), dims[o], mapped(o, grads, at), mapped(o, gcount, 8 * me)]
        if put:
            staging = b.grad_staging.data_ptr() + o * b.grad_staging_bytes
            assert row[5:] == [o, grads + at, gcount + 8 * me, staging]
            assert b.grad_staging_bytes % 16 == 0 and b.grad_staging_bytes >= rows * dims[o] * elem

    # A step: the four launches (kernels recorded) get the put path and its tables.
    launched = {}

    def recorder(name):
        def launch(*args, **kwargs):
            launched[name] = (args, kwargs)

        return launch

    for name in ("rows_put", "output_take", "grads_put"):
        setattr(tw_device_exchange, name, recorder(name))
    exchange._check = lambda route: None
    batch = 5
    record = torch.zeros(exchange._err_at + RECORD_WORDS, dtype=torch.int64)
    route = DeviceRoute(record=record, my_batch=batch, out_rows=batch, step=1)
    exchange._my_batches.append((batch, batch))
    pooled = exchange.exchange_pooled(torch.zeros(world_size * rows, dims[me]), route)
    grad = torch.ones(batch, sum(dims))
    exchange.exchange_grads(grad, route, torch.Size([world_size * rows, dims[me]]), divide=True)
    for name in ("rows_put", "output_take", "grads_put"):
        if name == "rows_put" and not dims[me]:
            assert name not in launched
            continue
        args, kwargs = launched[name]
        assert kwargs == {"put_path": put}, (name, kwargs)
    if dims[me]:
        # This rank's own rows straight into its output; every generation's table for
        # the others (the kernel picks the step's on the device).
        assert launched["rows_put"][0][2] is pooled and launched["rows_put"][0][3] == me
        assert launched["rows_put"][0][4] is exchange._out_addrs
        assert torch.equal(exchange._out_addrs, torch.stack(p.out_addrs))
    take = launched["output_take"][0]
    assert take[1] is pooled and take[15] == (0, sum(dims[:me]), sum(dims[: me + 1])), "its own columns in place"
    assert take[4] is p.out_free_words and take[5] is p.ids_free_words
    assert launched["grads_put"][0][1] is p.grad_dests
    exchange.close()
    t.close()


def test_peers_on_another_node_get_put_tables_the_rest_mapped_addresses():
    # Rank 2 is "on another node": neither side maps the other.
    run_ranks(_tables_and_launches, 3, remote_path="auto", unmapped_by_rank={0: [2], 1: [2], 2: [0, 1]})


def test_remote_path_put_serves_every_other_peer_by_puts():
    run_ranks(_tables_and_launches, 3, remote_path="put", unmapped_by_rank={})


def test_every_peer_mapped_keeps_the_tables_and_launches_of_the_direct_path():
    run_ranks(_tables_and_launches, 2, remote_path="auto", unmapped_by_rank={})


def _unreachable(rank, world_size, why):
    unmapped = {0: [1], 1: [0]}[rank]
    _fake_nvshmem(rank, unmapped, arrives=False)
    if why == "none":
        import os

        os.environ["NVSHMEM_REMOTE_TRANSPORT"] = "none"
    with pytest.raises(PgasTransportUnavailableError) as info:
        _transport("auto")
    message = str(info.value)
    for r, q in ((0, 1), (1, 0)):
        assert f"rank {r}: no peer (NVLink/P2P) access to ranks [{q}]" in message, message
    detail = "NVSHMEM_REMOTE_TRANSPORT=none leaves" if why == "none" else "signals from ranks"
    assert detail in message, message
    for fix in ("NVSHMEM_REMOTE_TRANSPORT=ibrc", "NVSHMEM_IB_ENABLE_IBGDA=1", "one NVSHMEM PE"):
        assert fix in message, message


@pytest.mark.parametrize("why", ["no signal", "none"])
def test_a_peer_nvshmem_cannot_reach_raises_on_every_rank_with_what_to_set(why):
    run_ranks(_unreachable, 2, why=why)


def _options_reach_the_transport(rank, world_size):
    from torchrec_pgas.transport import get_transport

    _fake_nvshmem(rank, unmapped=[])
    gpu = torch.device("cuda", 0)
    auto = get_transport(dist.group.WORLD, gpu, PgasOptions(transport="nvshmem", timeout_s=5))
    put = get_transport(dist.group.WORLD, gpu, PgasOptions(transport="nvshmem", timeout_s=5, remote_path="put"))
    assert auto.direct == [True] * world_size
    assert put.direct == [q == rank for q in range(world_size)] and put.puts_anywhere


def test_get_transport_honours_remote_path():
    run_ranks(_options_reach_the_transport, 2)


# The GPU exchange's host bookkeeping of training and bad batches, on the stand-in.


def _update_choice(rank, world_size, qualifies):
    """Each rank's tables qualify for the fused update or not (``qualifies[rank]``):
    every rank takes the same path, decided once at the first training lookup, and
    checks the step at the same call (the forward, on FBGEMM's path)."""
    from torchrec_pgas.sharding.device_batch import DeviceRoute, LookupBatch

    _fake_nvshmem(rank, unmapped=[])
    exchange = _exchange(_transport("auto"), world_size, [8] * world_size)
    exchange._update.enabled = True  # a plan of fused tables that may take the fused update
    asked = []

    def groups(emb_modules):
        asked.append(1)
        return [] if qualifies[rank] else None

    exchange._update.groups = groups
    exchange._fused.rows = lambda emb_modules: torch.empty(0, 4, dtype=torch.int64)

    def lookup(grad: bool) -> DeviceRoute:
        route = DeviceRoute(torch.zeros(exchange._err_at + RECORD_WORDS, dtype=torch.int64), 5, 5, check_now=grad)
        with torch.set_grad_enabled(grad):
            # No batch to pool on this rank (``from_slots`` unset): only the choice.
            assert exchange.lookup_put(LookupBatch(groups=[], route=route, bags_per_feature=5), []) is None
        return route

    assert lookup(grad=False).check_now is False and exchange._update_agreed is None  # inference decides nothing
    agreed = all(qualifies)
    for _ in range(3):
        assert lookup(grad=True).check_now is (not agreed)
    assert exchange._update_agreed is agreed and exchange._update.enabled is agreed
    exchange.close()


@pytest.mark.parametrize("qualifies", [(True, True), (True, False), (False, True)])
def test_every_rank_takes_the_fused_update_or_none_does(qualifies):
    run_ranks(_update_choice, 2, qualifies=qualifies)


def _training_lookup_keys_ids_for_backward(rank, world_size):
    """A training lookup that pools from the slots enqueues, after its kernel, the fused
    update's keying and sort of the step's ids for a gradient of the lookup output's
    pitch; the backward applies the update to a gradient of exactly that shape (its
    rows read at the pitch the keys were given)."""
    from torchrec_pgas.sharding import tw_device_exchange
    from torchrec_pgas.sharding.device_batch import DeviceRoute, LookupBatch, SlotsLookup

    _fake_nvshmem(rank, unmapped=[])
    dims = [8, 12, 4][:world_size]
    exchange = _exchange(_transport("auto"), world_size, dims)
    exchange._update.enabled = True
    exchange._update.groups = lambda emb_modules: ["group"]
    exchange._fused.rows = lambda emb_modules: torch.empty(0, 4, dtype=torch.int64)
    ids, gathered = [object()], []
    exchange._update.ids_dtype = lambda groups: torch.int32
    exchange._groups.kjts = lambda *args, **kwargs: gathered.append(kwargs) or ids
    calls = []
    tw_device_exchange.lookup_put = lambda *args, **kwargs: calls.append("lookup_put")
    tw_device_exchange.driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda index: 7))

    def prepare(groups, kjts, bags_per_feature, pitch):
        calls.append(("prepare", groups, kjts, bags_per_feature, pitch))
        return ["sorted"]

    def apply(groups, prepared, grad, pitch, record, err, num_sources):
        calls.append(("apply", groups, prepared, tuple(grad.shape), pitch, num_sources))

    exchange._update.prepare, exchange._update.apply = prepare, apply
    buffers, cap = exchange._buffers, exchange._layout.batch_capacity
    buffers.hold(3, None)
    route = DeviceRoute(torch.zeros(exchange._err_at + RECORD_WORDS, dtype=torch.int64), 5, 5)
    batch = LookupBatch(groups=[], route=route, bags_per_feature=world_size * cap)
    batch.from_slots = SlotsLookup(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 3, 7)
    out = exchange.lookup_put(batch, [types.SimpleNamespace(emb_module=types.SimpleNamespace(weights_dev=None))])
    # At world size 1 the lookup output is the output's rows, whose gradient the update
    # reads as it is; else the slots' rows of every source.
    rows = 5 if world_size == 1 else world_size * cap
    assert route.grads_in_place is (world_size == 1) and route.out.shape == (5, sum(dims))
    assert out.shape == (rows, dims[rank]) and out.requires_grad
    assert calls == ["lookup_put", ("prepare", ["group"], ids, world_size * cap, dims[rank])], calls
    # The update's copy of the ids, in the dtype it reads.
    assert gathered == [{"exact": False, "for_update": True, "ids_dtype": torch.int32}], gathered
    out.backward(torch.ones(out.shape))
    assert calls[2:] == [("apply", ["group"], ["sorted"], (rows, dims[rank]), dims[rank], world_size)], calls
    if world_size == 1:
        tw_device_exchange.grads_put = lambda *args, **kwargs: calls.append("grads_put")
        grad_out = torch.randn(5, dims[0])
        grad = exchange.exchange_grads(grad_out, route, out.shape, divide=True)
        assert grad is grad_out and calls[-1] != "grads_put", "no copy, no put"
        # This sharding's columns of a module's gradient (``torch.cat``'s backward gives
        # a column slice) are read where they are; columns not adjacent are copied.
        sliced = torch.randn(5, dims[0] + 8)[:, 4 : 4 + dims[0]]
        assert exchange.exchange_grads(sliced, route, out.shape, divide=True) is sliced
        transposed = torch.randn(dims[0], 5).t()
        copied = exchange.exchange_grads(transposed, route, out.shape, divide=True)
        assert copied.is_contiguous() and torch.equal(copied, transposed)
    exchange.close()


def _own_rows_where_aligned(rank, world_size, dims):
    """A rank's own rows go straight into its output only where its columns are
    4-element aligned (the kernels' masks assume so); else through its slot, as any
    owner's: the put kernels are given no own requester, ``output_take`` no columns."""
    from torchrec_pgas.sharding import tw_device_exchange
    from torchrec_pgas.sharding.device_batch import DeviceRoute

    _fake_nvshmem(rank, unmapped=[])
    exchange = _exchange(_transport("auto"), world_size, dims)
    launched = {}
    for name in ("rows_put", "output_take"):
        setattr(tw_device_exchange, name, lambda *args, name=name, **kwargs: launched.setdefault(name, args))
    exchange._check = lambda route: None
    route = DeviceRoute(torch.zeros(exchange._err_at + RECORD_WORDS, dtype=torch.int64), 5, 5, step=1)
    exchange._my_batches.append((5, 5))
    pooled = exchange.exchange_pooled(torch.zeros(world_size * exchange._layout.batch_capacity, dims[rank]), route)
    begin = sum(dims[:rank])
    aligned = begin % 4 == 0 and dims[rank] % 4 == 0
    if dims[rank]:
        assert launched["rows_put"][2] is pooled and launched["rows_put"][3] == (rank if aligned else -1)
    own = (0, begin, begin + dims[rank]) if aligned else (0, 0, 0)
    assert launched["output_take"][1] is pooled and launched["output_take"][15] == own
    exchange.close()


@pytest.mark.parametrize("dims", [[6, 8], [8, 6, 4], [4, 0, 12]])
def test_own_rows_in_place_only_where_columns_are_aligned(dims):
    run_ranks(_own_rows_where_aligned, len(dims), dims=dims)


@pytest.mark.parametrize("world_size", [1, 3])
def test_training_lookup_keys_ids_for_the_backward(world_size):
    run_ranks(_training_lookup_keys_ids_for_backward, world_size)


def _bad_batch_rows(rank, world_size):
    """A bad batch reports no samples (owners store no rows for it): the requester's
    output take expects none, and its (NaN) output still has the batch's size."""
    from torchrec_pgas.kernels.rows_put import programs_per_requester
    from torchrec_pgas.sharding import tw_device_exchange
    from torchrec_pgas.sharding.device_batch import DeviceRoute

    _fake_nvshmem(rank, unmapped=[])
    dims = [8] * world_size
    exchange = _exchange(_transport("auto"), world_size, dims)
    taken = []
    tw_device_exchange.output_take = lambda *args, **kwargs: taken.append(args)
    tw_device_exchange.rows_put = lambda *args, **kwargs: None
    for reported, rows in ((0, 3), (4, 4)):
        route = DeviceRoute(torch.zeros(exchange._err_at + RECORD_WORDS, dtype=torch.int64), reported, rows, step=1)
        out = exchange.exchange_pooled(torch.zeros(world_size * exchange._buffers.sizes.rows, dims[rank]), route)
        assert out.shape == (rows, sum(dims))
        assert taken[-1][1] is out and taken[-1][11] == programs_per_requester(reported)
    exchange.close()


def test_a_bad_batch_output_has_its_size_and_expects_no_rows():
    run_ranks(_bad_batch_rows, 2)


def test_output_rows_of_a_bad_batch_are_its_own_size_within_capacity():
    from torchrec import KeyedJaggedTensor

    from torchrec_pgas.sharding.tw_device_exchange import _output_rows

    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(6), lengths=torch.ones(6, dtype=torch.int64))
    assert _output_rows(kjt, 3, bad=False, capacity=128) == 3
    assert _output_rows(kjt, 0, bad=True, capacity=128) == 3  # the header says 0: its output has 3 rows
    assert _output_rows(kjt, 0, bad=True, capacity=2) == 0  # over capacity: nothing to write
    broken = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(3), lengths=torch.ones(3, dtype=torch.int64))
    assert _output_rows(broken, 0, bad=True, capacity=128) in (0, 1)  # a size, never an error


def _records_between_steps(rank, world_size):
    """What the ring of step records holds is raised by ``raise_errors`` once the device
    wrote it (here: this test), oldest first: records of good steps pass (and leave no
    cause behind), a step a source reported a bad batch of raises on every rank naming
    the source, feature and id, and a wait that timed out raises as such."""
    from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Header, Status
    from torchrec_pgas.sharding.tw_base import PgasInputError
    from torchrec_pgas.transport import PgasTimeoutError

    _fake_nvshmem(rank, unmapped=[])
    exchange = _exchange(_transport("auto"), world_size, [8] * world_size)
    records = exchange._errors
    at = exchange._err_at

    def write(step, headers, err=(0, 0, 0, 0)):
        """The device's copy of output step ``step``'s record into the ring."""
        words = torch.zeros(records.ring.size(1), dtype=torch.int64)
        for s, h in enumerate(headers):
            words[s * HEADER_WORDS : (s + 1) * HEADER_WORDS] = h.encode()
        words[at : at + 4] = torch.tensor(err)
        words[at + 4] = step  # the ids step
        words[-1] = step
        records.ring[step % records.ring.size(0)] = words

    good = [Header(Status.OK, 5, 9, False, ())] * world_size
    bad = list(good)
    bad[world_size - 1] = Header(Status.ID_OUT_OF_RANGE, 5, 9, False, (1, 77, 10))
    exchange._out_step = 3
    write(1, good)
    exchange._failure_cause = RuntimeError("from an earlier send")
    exchange.raise_errors()  # step 1 is good; steps 2 and 3 are not written yet
    assert records.checked == 1 and exchange._failure_cause is None
    write(3, good)
    exchange.raise_errors()  # step 3 waits behind step 2
    assert records.checked == 1
    write(2, bad)
    with pytest.raises(PgasInputError) as info:
        exchange.raise_errors()
    message = str(info.value)
    assert f"step 2: rank {world_size - 1} sent id 77 for feature 'f1' of table 't1'" in message, message
    assert records.checked == 3
    exchange.raise_errors()  # raised once
    exchange._out_step = 4
    write(4, good, err=(1, 0, 1, 4))
    with pytest.raises(PgasTimeoutError):
        exchange.raise_errors()
    exchange.close()


def test_step_records_raise_bad_steps_and_pass_good_ones():
    run_ranks(_records_between_steps, 2)


def _too_large(rank, world_size):
    from torchrec_pgas.kernels.ids_slot import Capacity
    from torchrec_pgas.sharding.tw_device_setup import MAX_BATCH_CAPACITY

    _fake_nvshmem(rank, unmapped=[])
    transport = _transport("auto")
    with pytest.raises(
        ValueError, match=rf"slots of 3000000 samples .* more than .* kernels take \({MAX_BATCH_CAPACITY}\)"
    ):
        _exchange(transport, world_size, [4, 4], Capacity(2.0, max_batch=3_000_000))
    exchange = _exchange(transport, world_size, [4, 4], Capacity(2.0, max_batch=1000))
    assert exchange._layout.batch_capacity == 1000


def test_slots_past_what_the_kernels_take_are_refused_on_every_rank():
    """``rows_put`` and ``grads_put`` launch a program per 32 samples of a slot on a grid
    axis CUDA caps at 65535: a larger slot would fail to launch at the first step."""
    run_ranks(_too_large, 2)
