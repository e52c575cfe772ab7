"""The GPU row-wise exchange's routing of batches that hold other shardings' features,
in any order (the direct path of modules mixing ``pgas_table_wise`` and
``pgas_row_wise``), on the CPU: ``DeviceRwExchange`` on a stand-in transport routes
with ``row_buckets`` run by Triton's interpreter, against a per-owner oracle (the ids
of the owner's block of each of the sharding's features, local to the block, in the
sharding's order); ``MeanAfterSum``'s divisor of such a batch against TorchRec's
``_create_mean_pooling_divisor`` of the batch permuted into the sharding's order, bit
for bit. Nothing here reads the routed batch back before the oracle does: the routing
itself is the GPU's (no host sync), only run on the CPU."""

import os
import random
import subprocess
import sys
import types
from typing import List, Optional, Sequence, Tuple

import pytest
import torch

pytest.importorskip("triton")

from torchrec import KeyedJaggedTensor, PoolingType
from torchrec.distributed.embeddingbag import _create_mean_pooling_divisor

from torchrec_pgas.kernels.ids_header import runs_of
from torchrec_pgas.kernels.ids_slot import Capacity, Status
from torchrec_pgas.sharding.device_routing import MAX_RUNS, RowBlockIds
from torchrec_pgas.sharding.mean_after_sum import MeanAfterSum
from torchrec_pgas.sharding.tw_base import TwFeature

CPU = torch.device("cpu")

if os.environ.get("TRITON_INTERPRET") != "1":
    # The interpreter must be chosen before Triton is first imported: in a process of
    # its own (as tests/test_kernels_interpreted.py).
    def test_routing_run_by_the_interpreter_matches_its_oracle():
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interpreted"],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]
        assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]

else:
    import triton.runtime.interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor

    def _patched(tensor, scope):
        # As in test_kernels_interpreted.py: numpy 2 and Triton 3.6's scalar arguments.
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patched

_interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter's process")


# ------------------------------------------------------------------ the cases


class Case:
    """A module's features (``rows``: the fewest rows of the tables that pool each),
    the row-wise sharding's features in its order (``sharding``: ``TwFeature`` with its
    table's rows; a feature may come twice, pooled by two tables), and the order of
    the batches (``keys``)."""

    def __init__(self, seed: int, world: int, duplicate: bool = False) -> None:
        rnd = random.Random(seed)
        self.world = world
        n = rnd.randint(2, 7)
        names = [f"k{i}" for i in range(n)]
        self.rows = {k: rnd.randint(world, 60) for k in names}
        own = rnd.sample(names, rnd.randint(2, n))
        self.sharding = [TwFeature(k, f"t_{k}", self.rows[k] + rnd.randint(0, 9)) for k in own]
        if duplicate:  # a second table pooling the first feature, with the same blocks
            f = self.sharding[0]
            self.sharding.append(TwFeature(f.name, "t_dup", self.block(f) * world))
        self.keys = rnd.sample(names, n)
        self.pos = [self.keys.index(f.name) for f in self.sharding]

    def block(self, f: TwFeature) -> int:
        return (f.num_embeddings + self.world - 1) // self.world

    def others(self) -> List[TwFeature]:
        """Every feature of the module with the rows its ids index, as the sharder
        gives them (``_feature_rows``)."""
        return [TwFeature(k, f"m_{k}", r) for k, r in self.rows.items()]

    def batch(self, batch_size: int, seed: int, weighted: bool) -> KeyedJaggedTensor:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 5, (len(self.keys) * batch_size,), generator=g)
        lengths[torch.rand(lengths.numel(), generator=g) < 0.2] = 0  # empty bags
        per_key = lengths.view(len(self.keys), batch_size).sum(1).tolist() if batch_size else [0] * len(self.keys)
        values = torch.cat(
            [torch.randint(0, self.rows[k], (n,), generator=g) for k, n in zip(self.keys, per_key)]
            + [torch.zeros(0, dtype=torch.int64)]
        )
        weights = torch.rand(values.numel(), generator=g) if weighted else None
        return KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths, weights=weights, stride=batch_size)


def _exchange(case: Case, weighted: bool, rank: int = 0):
    """A ``DeviceRwExchange`` of the case's sharding on a stand-in transport (it moves
    nothing here: only its routing and its set-up run)."""
    from torchrec_pgas.sharding.rw_device_exchange import DeviceRwExchange

    transport = types.SimpleNamespace(device=CPU, rank=rank, world_size=case.world)
    w = case.world
    local = [
        [max(0, min(case.block(f), f.num_embeddings - r * case.block(f))) for f in case.sharding] for r in range(w)
    ]
    return DeviceRwExchange(
        transport,  # type: ignore[arg-type]
        features=case.sharding,
        local_rows=local,
        dims=[4] * len(case.sharding),
        mean=[False] * len(case.sharding),
        group_sizes=[len(case.sharding)],
        weighted=weighted,
        lookup_reads_only_bags=True,
        fused_lookup=True,
        out_dtype=torch.float32,
        capacity=Capacity(1.0),
        name="pgas_row_wise",
    )


def _bags(values, offsets, feature: int, batch: int, weights=None) -> List[Tuple[list, Optional[list]]]:
    """Feature ``feature``'s bags of a KJT's ``values, offsets`` (with weights)."""
    out = []
    for b in range(batch):
        lo, hi = int(offsets[feature * batch + b]), int(offsets[feature * batch + b + 1])
        out.append((values[lo:hi].tolist(), weights[lo:hi].tolist() if weights is not None else None))
    return out


def _oracle(case: Case, kjt: KeyedJaggedTensor, owner: int) -> List[List[Tuple[list, Optional[list]]]]:
    """Owner ``owner``'s part of ``kjt``, per sharding feature in the sharding's order:
    per bag the ids of its block, local to the block, in their order (with weights)."""
    batch, offsets, weights = kjt.stride(), kjt.offsets(), kjt.weights_or_none()
    out = []
    for f, p in zip(case.sharding, case.pos):
        lo, hi = owner * case.block(f), (owner + 1) * case.block(f)
        bags = []
        for ids, ws in _bags(kjt.values(), offsets, p, batch, weights):
            keep = [i for i, x in enumerate(ids) if lo <= x < hi]
            bags.append(([ids[i] - lo for i in keep], [ws[i] for i in keep] if ws is not None else None))
        out.append(bags)
    return out


# ------------------------------------------------------------- which orders


def test_row_blocks_route_any_order_of_few_runs():
    """Any order of the sharding's features among others, up to ``MAX_RUNS`` runs; a
    feature two tables pool takes one bucketing, so their blocks must agree."""
    rw = RowBlockIds(torch.tensor([4, 7]), 2)
    assert rw.routable([0, 1]) and rw.routable([0, 1], 2) and rw.routable([1, 0])
    assert rw.routable([0, 1], 3) and rw.routable([1, 2], 3) and rw.routable([2, 0], 5)
    n = MAX_RUNS + 1
    spread = RowBlockIds(torch.full((n,), 3), 2)
    assert spread.routable(list(range(0, 2 * n - 2, 2)) + [2 * n - 3], 2 * n)  # MAX_RUNS runs
    assert not spread.routable(list(range(0, 2 * n, 2)), 2 * n)  # one run too many
    assert spread.routable(list(range(n, 2 * n)), 2 * n)
    assert RowBlockIds(torch.tensor([5, 5, 2]), 3).routable([2, 2, 0], 4)
    assert not RowBlockIds(torch.tensor([5, 6, 2]), 3).routable([2, 2, 0], 4)


def test_adopted_order_routes_each_owner_its_features_as_runs():
    """After ``adopt_input_order`` owner ``r``'s features are its bucket's, in the
    sharding's order, wherever the batch has them; other features are no one's."""
    case = Case(seed=3, world=3)
    x = _exchange(case, weighted=False)
    f, n = len(case.sharding), len(case.keys)
    # A feature neither the sharding nor the module knows: refused, nothing changed.
    assert not x.adopt_input_order(case.keys + ["stranger"], case.others())
    assert x._routing.routed_features(1, x._input_pos) == list(range(f, 2 * f))
    assert x.takes_input_order(case.keys) and x.adopt_input_order(case.keys, case.others())
    for r in range(case.world):
        routed = x._routing.routed_features(r, x._input_pos)
        assert routed == [r * n + p for p in case.pos]
        assert len(runs_of(routed)) <= MAX_RUNS


def test_orders_of_too_many_runs_keep_torchrec_path():
    world, n = 2, MAX_RUNS + 1
    own = [TwFeature(f"s{i}", f"t{i}", 10) for i in range(n)]
    case = Case(seed=0, world=world)
    case.sharding, case.rows = own, {**{f.name: 10 for f in own}, **{f"o{i}": 10 for i in range(n)}}
    x = _exchange(case, weighted=False)
    interleaved = [k for i in range(n) for k in (f"s{i}", f"o{i}")]
    assert not x.takes_input_order(interleaved)
    assert x.takes_input_order([f"o{i}" for i in range(n)] + [f.name for f in own])


# ----------------------------------------------------------- the routing itself


@_interpreted
@pytest.mark.parametrize("seed", range(8))
def test_interpreted_routing_gives_each_owner_its_blocks(seed):
    """``send_input`` of a batch in the adopted order: owner ``r``'s routed features hold
    exactly the oracle's ids (and weights), bag by bag."""
    from torchrec_pgas.sharding.device_batch import send_input

    world = 1 + seed % 4
    case = Case(seed=100 + seed, world=world, duplicate=seed % 3 == 2)
    weighted = seed % 2 == 1
    x = _exchange(case, weighted)
    assert x.takes_input_order(case.keys) and x.adopt_input_order(case.keys, case.others())
    for step, batch_size in enumerate([1 + seed % 5, 7, 0]):
        kjt = case.batch(batch_size, 10 * seed + step, weighted)
        sent = send_input(kjt, x._host_problem(kjt), weighted, x._routing, CPU)
        assert sent.problem is None and sent.batch == batch_size
        if not batch_size:
            continue
        assert sent.offsets.numel() == world * len(case.keys) * batch_size + 1
        for r in range(world):
            routed = x._routing.routed_features(r, x._input_pos)
            got = [_bags(sent.values, sent.offsets, q, batch_size, sent.weights) for q in routed]
            assert got == _oracle(case, kjt, r), (seed, step, r)


@_interpreted
def test_interpreted_refused_batch_keeps_the_routed_layout():
    """A batch sent as its header alone (here: float ids) is not routed, but its
    offsets and lengths are laid out as routed ones (``ids_header`` reads them at the
    owners' runs): every id of the sharding's features counted for owner 0."""
    from torchrec_pgas.sharding.device_batch import send_input

    case = Case(seed=5, world=3)
    x = _exchange(case, weighted=False)
    assert x.adopt_input_order(case.keys, case.others())
    good = case.batch(4, 1, False)
    kjt = KeyedJaggedTensor(keys=good.keys(), values=good.values().float(), lengths=good.lengths())
    problem = x._host_problem(kjt)
    assert problem is not None and problem[0] == Status.BAD_DTYPE
    sent = send_input(kjt, problem, False, x._routing, CPU)
    n, b = len(case.keys), 4
    assert sent.offsets.numel() == case.world * n * b + 1 and sent.lengths.numel() == case.world * n * b
    per_feature = sent.offsets[b::b] - sent.offsets[:-1:b]
    for r in range(case.world):
        for q, p in zip(x._routing.routed_features(r, x._input_pos), case.pos):
            expected = int(good.lengths()[p * b : (p + 1) * b].sum()) if r == 0 else 0
            assert int(per_feature[q]) == expected


# --------------------------------------------------------------- mean divisor


def _torchrec_divisor(kjt: KeyedJaggedTensor, pos: Sequence[int], dims, mean) -> torch.Tensor:
    """TorchRec's divisor of ``kjt`` permuted into the sharding's order (its features
    renamed apart: a feature two tables pool comes twice)."""
    own = kjt.permute(list(pos))
    keys = [f"s{i}" for i in range(len(pos))]
    own = KeyedJaggedTensor(
        keys=keys, values=own.values(), lengths=own.lengths(), weights=own.weights_or_none(), stride=kjt.stride()
    )
    return _create_mean_pooling_divisor(
        lengths=own.lengths(),
        keys=keys,
        offsets=own.offsets(),
        stride=own.stride(),
        stride_per_key=own.stride_per_key(),
        dim_per_key=torch.tensor(dims),
        pooling_type_to_rs_features={
            PoolingType.SUM.value: [k for k, m in zip(keys, mean) if not m],
            PoolingType.MEAN.value: [k for k, m in zip(keys, mean) if m],
        },
        embedding_names=keys,
        embedding_dims=list(dims),
        variable_batch_per_feature=False,
        kjt_inverse_order=torch.empty(0, dtype=torch.int64),
        kjt_key_indices={k: i for i, k in enumerate(keys)},
        kt_key_ordering=torch.arange(len(keys)),
        weights=own.weights_or_none(),
    )


@pytest.mark.parametrize("seed", range(8))
def test_divisor_of_a_batch_in_any_order_is_torchrecs(seed):
    """Bit for bit TorchRec's divisor of the sharding's features, read by position
    from the whole batch (weighted or not, mean and sum tables, a feature twice)."""
    rnd = random.Random(seed)
    case = Case(seed=200 + seed, world=2, duplicate=seed % 3 == 0)
    weighted = seed % 2 == 0
    f = len(case.sharding)
    dims = [4 * rnd.randint(1, 3) for _ in range(f)]
    mean = [rnd.random() < 0.6 for _ in range(f)]
    mean[0] = True
    m = MeanAfterSum(dims, mean, CPU)
    for step, batch_size in enumerate([3, 1 + seed, 5]):
        kjt = case.batch(batch_size, 7 * seed + step, weighted)
        got = m.divisor(kjt, case.pos)
        want = _torchrec_divisor(kjt, case.pos, dims, mean)
        assert got is not None and got.dtype == want.dtype and torch.equal(got, want), (seed, step)
        # The batch permuted into the sharding's order: the same divisor.
        own = kjt.permute(case.pos)
        assert torch.equal(m.divisor(own), want)
    assert m.divisor(case.batch(0, 1, weighted), case.pos) is None
    assert MeanAfterSum(dims, [False] * f, CPU).divisor(kjt, case.pos) is None


def test_divisor_of_lengths_past_the_weights_reads_none_of_them():
    """A weighted batch whose lengths count more ids than it has (its send refuses it)
    still gets a divisor, summed over its weights only: no read past them."""
    m = MeanAfterSum([4, 4], [True, True], CPU)
    past = torch.tensor([1.0] * 3 + [float("nan")] * 8)  # what a read past the weights sees
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([2, 5]), weights=past[:3], stride=1
    )
    divisor = m.divisor(kjt, [1, 0])
    # Feature "b" (the sharding's first) has one weight of its five ids, "a" two.
    assert divisor is not None and torch.equal(divisor, torch.tensor([[1.0] * 4 + [2.0] * 4]) + 1e-6)
