"""The PGAS cost model prices traffic by host: planner-only runs on multi-node topologies.

Rank ``r`` is on host ``r // local_world_size``. The oracles are TorchRec's own
estimates: on one host its table-wise and row-wise comms are ``X / intra_host_bw`` and
across hosts ``X / inter_host_bw`` for the same bytes ``X`` a PGAS shard moves, so each
PGAS term is rebuilt here peer by peer from those two numbers.
"""

import random
from statistics import mean
from typing import Dict, List, Tuple

import pytest
import torch
from torchrec.distributed.planner import Topology, shard_estimators
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints, Perf
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_pgas import PGAS_ROW_WISE, PGAS_TABLE_WISE, PgasEmbeddingBagCollectionSharder
from torchrec_pgas.planner import SIGNAL_LATENCY_MS, make_planner, pgas_sharders
from torchrec_pgas.planner.registration import scoped_registration

TW = ShardingType.TABLE_WISE.value
RW = ShardingType.ROW_WISE.value
#: Each PGAS type and the TorchRec type whose bytes and compute it shares.
PGAS_AND_TORCHREC = [(PGAS_TABLE_WISE, TW), (PGAS_ROW_WISE, RW)]
LOCAL = 8
MULTI_HOST = [(2 * LOCAL, LOCAL), (4 * LOCAL, LOCAL)]
BATCH = 512  # per GPU, whatever the world size
POOLING = 3.0  # ids per bag, so ids + lengths are (POOLING + 1) / POOLING of the ids


def _random_table() -> Tuple[int, int]:
    rng = random.Random()
    return (rng.randrange(20_000, 200_000), 4 * rng.randrange(32, 128))


TABLE = _random_table()  # (rows, dim), fresh each run; uneven row shards


def _topology(world_size: int, local_world_size: int, inter_host_bw: float) -> Topology:
    return Topology(
        world_size=world_size,
        local_world_size=local_world_size,
        compute_device="cuda",
        intra_host_bw=INTRA_NODE_BANDWIDTH,
        inter_host_bw=inter_host_bw,
    )


def _shard_perfs(
    world_size: int,
    local_world_size: int,
    sharding_type: str,
    inter_host_bw: float = CROSS_NODE_BANDWIDTH,
) -> List[Perf]:
    """The estimator's perf of every shard of ``TABLE`` sharded as ``sharding_type``."""
    (rows, dim) = TABLE
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])],
        device=torch.device("meta"),
    )
    constraints = {"t": ParameterConstraints(sharding_types=[sharding_type], pooling_factors=[POOLING])}
    topology = _topology(world_size, local_world_size, inter_host_bw)
    estimators = [
        shard_estimators.EmbeddingPerfEstimator(topology, constraints=constraints),
        shard_estimators.EmbeddingStorageEstimator(topology, constraints=constraints),
    ]
    with scoped_registration():
        options = EmbeddingEnumerator(
            topology, batch_size=BATCH, estimator=estimators, constraints=constraints
        ).enumerate(ebc, [PgasEmbeddingBagCollectionSharder()])
    (option,) = [o for o in options if o.compute_kernel == "fused"]
    perfs = [shard.perf for shard in option.shards]
    assert all(p is not None for p in perfs)
    return perfs  # type: ignore[return-value]


def _signals_ms(world_size: int) -> float:
    return (world_size - 1) * SIGNAL_LATENCY_MS


def _put_oracle(all_intra_ms: float, all_inter_ms: float, world_size: int, local: int) -> float:
    """Owner's put time, peer by peer, averaged over every rank as the owner.

    ``all_intra_ms`` / ``all_inter_ms``: the time of all the bytes over one link kind.
    """
    per_owner = []
    for owner in range(world_size):
        same = [p for p in range(world_size) if p // local == owner // local]
        other = [p for p in range(world_size) if p // local != owner // local]
        per_owner.append(max(len(same) * all_intra_ms / world_size, len(other) * all_inter_ms / world_size))
    return mean(per_owner)


def _torchrec_flat_and_cross(
    world_size: int, local: int, torchrec_type: str, inter_host_bw: float
) -> Tuple[List[Perf], List[Perf]]:
    """TorchRec's estimates with every rank on one host (all bytes at intra-host
    bandwidth) and on the given hosts (all bytes at inter-host bandwidth)."""
    flat = _shard_perfs(world_size, world_size, torchrec_type, inter_host_bw)
    cross = _shard_perfs(world_size, local, torchrec_type, inter_host_bw)
    return (flat, cross)


@pytest.mark.parametrize("world_size,local", [(LOCAL, LOCAL), *MULTI_HOST, (12, LOCAL)])
@pytest.mark.parametrize("inter_host_bw", [CROSS_NODE_BANDWIDTH, CROSS_NODE_BANDWIDTH / 2])
@pytest.mark.parametrize("pgas_type,torchrec_type", PGAS_AND_TORCHREC)
def test_pgas_comms_are_priced_per_peer_by_host(
    world_size: int, local: int, inter_host_bw: float, pgas_type: str, torchrec_type: str
) -> None:
    pgas = _shard_perfs(world_size, local, pgas_type, inter_host_bw)
    (flat, cross) = _torchrec_flat_and_cross(world_size, local, torchrec_type, inter_host_bw)
    sig = _signals_ms(world_size)
    ids_and_lengths = (POOLING + 1) / POOLING
    for p, f, c in zip(pgas, flat, cross, strict=True):
        assert p.fwd_compute == c.fwd_compute and p.bwd_compute == c.bwd_compute
        ids = _put_oracle(f.input_dist_comms * ids_and_lengths, c.input_dist_comms * ids_and_lengths, world_size, local)
        assert p.input_dist_comms == pytest.approx(ids + sig, rel=1e-9), TABLE
        # TorchRec row-wise adds a batched copy to its backward all-gather; its forward
        # reduce-scatter moves the same bytes (fp32 both ways by default), so it prices both.
        pooled = _put_oracle(f.fwd_comms, c.fwd_comms, world_size, local)
        grads = pooled if torchrec_type == RW else _put_oracle(f.bwd_comms, c.bwd_comms, world_size, local)
        assert p.fwd_comms == pytest.approx(max(0.0, pooled - p.fwd_compute) + sig, rel=1e-9), TABLE
        assert p.bwd_comms == pytest.approx(max(0.0, grads - p.bwd_compute) + sig, rel=1e-9), TABLE


@pytest.mark.parametrize("world_size,local", [(LOCAL, LOCAL), *MULTI_HOST])
@pytest.mark.parametrize("pgas_type", [PGAS_TABLE_WISE, PGAS_ROW_WISE])
def test_halving_inter_host_bandwidth_doubles_the_cross_host_puts_only(
    world_size: int, local: int, pgas_type: str
) -> None:
    base = _shard_perfs(world_size, local, pgas_type)
    half = _shard_perfs(world_size, local, pgas_type, CROSS_NODE_BANDWIDTH / 2)
    sig = _signals_ms(world_size)
    for b, h in zip(base, half, strict=True):
        if world_size == local:
            assert h == b
            continue
        # With the defaults the off-host share (1/48 of the bandwidth for at least as
        # many bytes) is what the owner waits for, so the puts take twice as long.
        assert h.input_dist_comms - sig == pytest.approx(2 * (b.input_dist_comms - sig), rel=1e-9)
        for comms_b, comms_h, compute in (
            (b.fwd_comms, h.fwd_comms, b.fwd_compute),
            (b.bwd_comms, h.bwd_comms, b.bwd_compute),
        ):
            put = comms_b - sig + compute
            assert comms_b - sig > 0, "the cross-host puts are no longer exposed"
            assert comms_h - sig == pytest.approx(2 * put - compute, rel=1e-9), TABLE


@pytest.mark.parametrize("pgas_type,torchrec_type", PGAS_AND_TORCHREC)
def test_two_hosts_cost_more_than_one_by_the_inter_host_share(pgas_type: str, torchrec_type: str) -> None:
    # Same per-GPU batch: each rank's share of a shard's traffic is the same bytes on
    # 1 x 8 and 2 x 8; on 2 x 8 the 8 off-host shares ride the inter-host links.
    one = _shard_perfs(LOCAL, LOCAL, pgas_type)[0]
    two = _shard_perfs(2 * LOCAL, LOCAL, pgas_type)[0]
    one_host_ids = one.input_dist_comms - _signals_ms(LOCAL)
    off_host_ids = one_host_ids * INTRA_NODE_BANDWIDTH / CROSS_NODE_BANDWIDTH
    assert two.input_dist_comms - _signals_ms(2 * LOCAL) == pytest.approx(max(one_host_ids, off_host_ids), rel=1e-9)
    assert two.input_dist_comms > one.input_dist_comms
    # TorchRec's 1 x 8 forward comms are the 8 shares at intra-host bandwidth.
    one_host_pooled = _shard_perfs(LOCAL, LOCAL, torchrec_type)[0].fwd_comms
    off_host_pooled = one_host_pooled * INTRA_NODE_BANDWIDTH / CROSS_NODE_BANDWIDTH
    assert two.fwd_comms == pytest.approx(
        max(0.0, off_host_pooled - two.fwd_compute) + _signals_ms(2 * LOCAL), rel=1e-9
    )
    assert two.fwd_comms > one.fwd_comms and two.bwd_comms > one.bwd_comms
    assert two.total > one.total


def _comms(perf: Perf) -> float:
    return perf.input_dist_comms + perf.fwd_comms + perf.bwd_comms


def _sign(x: float) -> int:
    return (x > 1e-12) - (x < -1e-12)


@pytest.mark.parametrize("pgas_type,torchrec_type", PGAS_AND_TORCHREC)
def test_pgas_and_torchrec_estimates_move_the_same_way_with_topology(pgas_type: str, torchrec_type: str) -> None:
    # (world size, local world size, inter-host bandwidth), each step one change.
    steps: List[Tuple[int, int, float]] = [
        (LOCAL, LOCAL, CROSS_NODE_BANDWIDTH),
        (LOCAL, LOCAL, CROSS_NODE_BANDWIDTH / 2),
        (2 * LOCAL, LOCAL, CROSS_NODE_BANDWIDTH / 2),
        (2 * LOCAL, LOCAL, CROSS_NODE_BANDWIDTH),
        (4 * LOCAL, LOCAL, CROSS_NODE_BANDWIDTH),
        (4 * LOCAL, LOCAL, CROSS_NODE_BANDWIDTH / 2),
    ]
    comms: Dict[str, List[float]] = {
        t: [_comms(_shard_perfs(w, l, t, bw)[0]) for (w, l, bw) in steps] for t in (pgas_type, torchrec_type)
    }
    moves = {t: [_sign(b - a) for a, b in zip(c, c[1:])] for t, c in comms.items()}
    assert moves[pgas_type] == moves[torchrec_type] == [0, 1, -1, 1, 1], comms


@pytest.mark.parametrize("world_size,local", MULTI_HOST)
def test_multi_host_plan_with_pgas_constraints_is_valid(world_size: int, local: int) -> None:
    rng = random.Random()
    dims = {f"t{i}": 4 * rng.randrange(8, 96) for i in range(3 * world_size // 2)}
    rows = {name: rng.randrange(1_000, 50_000) for name in dims}
    names = list(dims)
    wanted = {name: [PGAS_TABLE_WISE] for name in names[0::3]}
    wanted |= {name: [PGAS_ROW_WISE] for name in names[1::3]}
    wanted |= {name: [TW, RW, PGAS_TABLE_WISE, PGAS_ROW_WISE] for name in names[2::3]}
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, embedding_dim=dims[n], num_embeddings=rows[n], feature_names=[f"f_{n}"])
            for n in names
        ],
        device=torch.device("meta"),
    )
    planner = make_planner(
        _topology(world_size, local, CROSS_NODE_BANDWIDTH),
        constraints={n: ParameterConstraints(sharding_types=t) for n, t in wanted.items()},
    )
    plan = planner.plan(ebc, pgas_sharders()).plan[""]
    assert set(plan) == set(names)
    used_ranks = set()
    for name, ps in plan.items():
        assert ps.sharding_type in wanted[name], (name, ps.sharding_type)
        shards = ps.sharding_spec.shards  # type: ignore[union-attr]
        assert ps.ranks == [s.placement.rank() for s in shards]
        for s in shards:
            # Rank r is on host r // local: its device is cuda:(r % local).
            assert s.placement.device() == torch.device("cuda", s.placement.rank() % local)
            assert s.shard_sizes[1] == dims[name] and s.shard_offsets[1] == 0
        used_ranks |= set(ps.ranks)
        if ps.sharding_type in (TW, PGAS_TABLE_WISE):
            assert len(shards) == 1 and shards[0].shard_sizes[0] == rows[name]
        else:
            assert sorted(ps.ranks) == list(range(world_size))
            offsets = [s.shard_offsets[0] for s in shards]
            assert offsets == sorted(offsets) and offsets[0] == 0
            ends = [o + s.shard_sizes[0] for o, s in zip(offsets, shards)]
            assert offsets[1:] == ends[:-1] and ends[-1] == rows[name]
    assert used_ranks == set(range(world_size))


def test_multi_host_topology_without_inter_host_bandwidth_is_refused() -> None:
    with pytest.raises(ValueError, match=r"16 ranks, 8 per host.*inter_host_bw is 0"):
        _shard_perfs(2 * LOCAL, LOCAL, PGAS_TABLE_WISE, inter_host_bw=0.0)
    # One host never crosses hosts, so its inter-host bandwidth may be left at 0.
    assert _shard_perfs(LOCAL, LOCAL, PGAS_TABLE_WISE, inter_host_bw=0.0)[0].total > 0
