"""Planner support for pgas_table_wise: registration, cost model, explicit planner."""

import importlib
import importlib.metadata
import logging
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
import tomllib
import torch
import torch.distributed as dist
from torchrec.distributed import model_parallel, sharding_plan
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import (
    EmbeddingShardingPlanner,
    Topology,
    enumerators,
    planners,
    shard_estimators,
    stats,
)
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator import estimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import torchrec_pgas
from torchrec_pgas import PGAS_TABLE_WISE, PgasEmbeddingBagCollectionSharder
from torchrec_pgas.planner import (
    make_planner,
    pgas_sharders,
    registration,
    scoped_registration,
)

TW = ShardingType.TABLE_WISE.value
CW = ShardingType.COLUMN_WISE.value

# Every (module, name) the registration swaps, with TorchRec's original object.
_PATCHED_NAMES = [
    (sharding_plan, "calculate_shard_sizes_and_offsets"),
    (enumerators, "calculate_shard_sizes_and_offsets"),
    (enumerators, "get_partition_by_type"),
    (shard_estimators, "_calculate_shard_io_sizes"),
    (stats, "_calculate_shard_io_sizes"),
    (stats, "_get_sharding_type_abbr"),
    (estimator, "get_embedding_perf_sharding_evaluator"),
    (sharding_plan, "get_default_sharders"),
    (model_parallel, "get_default_sharders"),
    (planners, "get_default_sharders"),
    (EmbeddingEnumerator, "enumerate"),
]
ORIGINALS = {(owner, name): getattr(owner, name) for owner, name in _PATCHED_NAMES}


@pytest.fixture(autouse=True)
def _unregistered() -> Iterator[None]:
    torchrec_pgas.unregister()
    yield
    torchrec_pgas.unregister()


def _ebc(dims: Dict[str, int]) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=1000, feature_names=[f"f_{name}"])
        for name, dim in dims.items()
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _topology(world_size: int = 2) -> Topology:
    return Topology(world_size=world_size, compute_device="cpu")


def _constraints(**types: List[str]) -> Dict[str, ParameterConstraints]:
    return {name: ParameterConstraints(sharding_types=t) for name, t in types.items()}


def _types(
    ebc: EmbeddingBagCollection,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    planner: Optional[EmbeddingShardingPlanner] = None,
) -> Dict[str, str]:
    planner = planner or EmbeddingShardingPlanner(topology=_topology(), constraints=constraints)
    plan = planner.plan(ebc, [PgasEmbeddingBagCollectionSharder()])
    return {name: ps.sharding_type for name, ps in plan.plan[""].items()}


def _enumerate(ebc: EmbeddingBagCollection, world_size: int = 2, is_inference: bool = False) -> List[ShardingOption]:
    topology = _topology(world_size)
    estimators = [
        shard_estimators.EmbeddingPerfEstimator(topology, is_inference=is_inference),
        shard_estimators.EmbeddingStorageEstimator(topology),
    ]
    with scoped_registration():
        enumerator = EmbeddingEnumerator(topology, batch_size=512, estimator=estimators)
        return enumerator.enumerate(ebc, [PgasEmbeddingBagCollectionSharder()])


def _option(options: List[ShardingOption], sharding_type: str) -> ShardingOption:
    return next(o for o in options if o.sharding_type == sharding_type and o.compute_kernel == "fused")


def _ebc_sharder(sharders: list) -> object:
    return next(s for s in sharders if s.module_type is EmbeddingBagCollection)


def test_stock_planner_places_pgas_only_where_constrained() -> None:
    torchrec_pgas.register()
    ebc = _ebc({"a": 64, "b": 64, "c": 64})
    constraints = _constraints(a=[PGAS_TABLE_WISE], b=[TW], c=[CW])
    assert _types(ebc, constraints) == {"a": PGAS_TABLE_WISE, "b": TW, "c": CW}


def test_planner_prefers_pgas_when_both_allowed() -> None:
    torchrec_pgas.register()
    ebc = _ebc({"a": 64, "b": 64})
    assert _types(ebc, _constraints(a=[TW, PGAS_TABLE_WISE], b=[TW, PGAS_TABLE_WISE])) == {
        "a": PGAS_TABLE_WISE,
        "b": PGAS_TABLE_WISE,
    }


def test_planner_keeps_table_wise_where_signals_cost_more_than_the_puts() -> None:
    # A 4-wide table moves ~32 KB per batch: its puts take less than one signal.
    torchrec_pgas.register()
    assert _types(_ebc({"a": 4}), _constraints(a=[TW, PGAS_TABLE_WISE])) == {"a": TW}


@pytest.mark.parametrize("world_size", [2, 16])
def test_pgas_shards_have_perf_and_storage(world_size: int) -> None:
    options = _enumerate(_ebc({"a": 128}), world_size)
    pgas, tw = _option(options, PGAS_TABLE_WISE), _option(options, TW)
    assert pgas.partition_by == tw.partition_by
    assert [s.size for s in pgas.shards] == [s.size for s in tw.shards]
    for pgas_shard, tw_shard in zip(pgas.shards, tw.shards):
        assert pgas_shard.storage == tw_shard.storage and pgas_shard.storage.ddr > 0
        assert pgas_shard.perf is not None and tw_shard.perf is not None
        assert pgas_shard.perf.fwd_compute == tw_shard.perf.fwd_compute
        assert pgas_shard.perf.bwd_compute == tw_shard.perf.bwd_compute
        assert 0 < pgas_shard.perf.fwd_comms < tw_shard.perf.fwd_comms
        assert 0 < pgas_shard.perf.bwd_comms < tw_shard.perf.bwd_comms
        assert pgas_shard.perf.input_dist_comms > 0
        assert pgas_shard.perf.total < tw_shard.perf.total


def test_inference_estimate_has_no_backward() -> None:
    perf = _option(_enumerate(_ebc({"a": 128}), is_inference=True), PGAS_TABLE_WISE).shards[0].perf
    assert perf is not None
    assert perf.bwd_compute == perf.bwd_comms == 0 and perf.fwd_comms > 0


def test_embedding_stats_print_pgas_shards(caplog: pytest.LogCaptureFixture) -> None:
    torchrec_pgas.register()
    with caplog.at_level(logging.INFO, logger=stats.__name__):
        _types(_ebc({"a": 64, "b": 64}), _constraints(a=[PGAS_TABLE_WISE], b=[TW]))
    assert "PTW" in caplog.text


def test_register_is_idempotent() -> None:
    torchrec_pgas.register()
    patched = {key: getattr(*key) for key in ORIGINALS}
    torchrec_pgas.register()
    assert torchrec_pgas.is_registered()
    for key, value in patched.items():
        assert getattr(*key) is value
        assert value is not ORIGINALS[key], key
    torchrec_pgas.unregister()
    assert all(getattr(*key) is original for key, original in ORIGINALS.items())


def test_unregister_restores_originals() -> None:
    torchrec_pgas.register()
    torchrec_pgas.unregister()
    torchrec_pgas.unregister()
    assert not torchrec_pgas.is_registered()
    for key, original in ORIGINALS.items():
        assert getattr(*key) is original, key
    with pytest.raises(ValueError, match=PGAS_TABLE_WISE):
        _types(_ebc({"a": 64}), _constraints(a=[PGAS_TABLE_WISE]))


def test_unregister_restores_modules_imported_while_registered() -> None:
    torchrec_pgas.register()
    name = "tests_planner_late_import"
    late = type(sys)(name)
    late.__dict__["get_default_sharders"] = sharding_plan.get_default_sharders
    sys.modules[f"torchrec.{name}"] = late
    try:
        torchrec_pgas.unregister()
        assert late.get_default_sharders is ORIGINALS[(sharding_plan, "get_default_sharders")]
    finally:
        del sys.modules[f"torchrec.{name}"]


def test_default_sharders_offer_pgas_while_registered() -> None:
    torchrec_pgas.register()
    for module in (sharding_plan, model_parallel, planners):
        sharders = module.get_default_sharders()
        ebc_sharders = [s for s in sharders if s.module_type is EmbeddingBagCollection]
        assert len(ebc_sharders) == 1
        assert isinstance(ebc_sharders[0], PgasEmbeddingBagCollectionSharder)
        assert len(sharders) == len(ORIGINALS[(sharding_plan, "get_default_sharders")]())
    torchrec_pgas.unregister()
    assert type(_ebc_sharder(sharding_plan.get_default_sharders())) is EmbeddingBagCollectionSharder


def test_collective_plan_without_sharders_uses_pgas_sharder() -> None:
    torchrec_pgas.register()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        planner = EmbeddingShardingPlanner(topology=_topology(), constraints=_constraints(a=[PGAS_TABLE_WISE]))
        plan = planner.collective_plan(_ebc({"a": 64}))
    finally:
        dist.destroy_process_group()
    assert plan.plan[""]["a"].sharding_type == PGAS_TABLE_WISE


def test_unknown_constraint_type_is_named_by_stock_planner() -> None:
    torchrec_pgas.register()
    constraints = _constraints(a=[TW, "pgas_tabel_wise"])
    with pytest.raises(ValueError, match=r"'a'.*'pgas_tabel_wise'.*pgas_table_wise"):
        _types(_ebc({"a": 64}), constraints)


def test_unknown_constraint_type_is_named_by_make_planner() -> None:
    message = r"'a'.*'pgas_tabel_wise'.*table_wise.*pgas_table_wise"
    with pytest.raises(ValueError, match=message):
        make_planner(_topology(), constraints=_constraints(a=["pgas_tabel_wise"]))


def test_make_planner_plans_pgas_without_leaving_patches() -> None:
    ebc = _ebc({"a": 64, "b": 64, "c": 64})
    planner = make_planner(_topology(), constraints=_constraints(a=[PGAS_TABLE_WISE], b=[TW]))
    plan = planner.plan(ebc, pgas_sharders())
    types = {name: ps.sharding_type for name, ps in plan.plan[""].items()}
    assert types["a"] == PGAS_TABLE_WISE and types["b"] == TW
    assert isinstance(planner, EmbeddingShardingPlanner)
    assert not torchrec_pgas.is_registered()
    assert all(getattr(*key) is original for key, original in ORIGINALS.items())


def test_scoped_registration_keeps_register_in_force() -> None:
    torchrec_pgas.register()
    with scoped_registration():
        pass
    original = ORIGINALS[(sharding_plan, "get_default_sharders")]
    assert sharding_plan.get_default_sharders is not original


def test_pgas_sharders_replace_only_the_ebc_sharder() -> None:
    options = torchrec_pgas.PgasOptions(timeout_s=5.0)
    sharders = pgas_sharders(fused_params={"learning_rate": 0.5}, options=options)
    defaults = sharding_plan.get_default_sharders()
    assert [s.module_type for s in sharders] == [s.module_type for s in defaults]
    ours = _ebc_sharder(sharders)
    assert isinstance(ours, PgasEmbeddingBagCollectionSharder)
    assert ours.fused_params == {"learning_rate": 0.5}
    assert ours._pgas_options is options


@pytest.mark.parametrize("version", ["1.5.2", "1.10.0", "2.0.0", "nightly"])
def test_unsupported_torchrec_version_is_refused(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(registration, "_installed_torchrec_version", lambda: version)
    with pytest.raises(RuntimeError, match=rf"torchrec >=1\.6,<1\.10; found torchrec {version}"):
        torchrec_pgas.register()
    assert not torchrec_pgas.is_registered()
    assert sharding_plan.get_default_sharders is ORIGINALS[(sharding_plan, "get_default_sharders")]


def test_supported_torchrec_version_range(monkeypatch: pytest.MonkeyPatch) -> None:
    for version in ("1.6.0", "1.9.1+cu128"):
        monkeypatch.setattr(registration, "_installed_torchrec_version", lambda: version)
        torchrec_pgas.register()
        torchrec_pgas.unregister()


def test_entry_point_resolves_to_register() -> None:
    try:
        importlib.metadata.distribution("torchrec-pgas")
    except importlib.metadata.PackageNotFoundError:
        pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
        value = pyproject["project"]["entry-points"]["torchrec.plugins"]["pgas"]
    else:
        (entry_point,) = importlib.metadata.entry_points(group="torchrec.plugins", name="pgas")
        value = entry_point.value
    module_name, attr = value.split(":")
    assert getattr(importlib.import_module(module_name), attr) is registration.register


def test_sharder_offers_both_pgas_types_on_cpu_and_gpu():
    from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder

    sharder = PgasEmbeddingBagCollectionSharder()
    for device_type in ("cpu", "cuda"):
        assert {"pgas_table_wise", "pgas_row_wise"} <= set(sharder.sharding_types(device_type))


def test_pgas_row_wise_is_laid_out_like_row_wise():
    from torchrec_pgas.planner.layout import PGAS_LAYOUTS, torchrec_layout

    assert torchrec_layout("pgas_row_wise") == "row_wise"
    assert PGAS_LAYOUTS["pgas_row_wise"].abbreviation == "PRW"


def _unshardable_by_pgas(rank, world_size, kind, via):
    from torch import nn
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    model = nn.Module()
    if kind == "EmbeddingCollection":
        model.m = EmbeddingCollection(
            tables=[EmbeddingConfig(name="e0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])]
        )
    else:
        ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="e0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])],
            is_weighted=True,
        )
        model.m = FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection({"f0": 4}))
    model.b = _ebc({"a": 64})
    constraints = _constraints(e0=[PGAS_TABLE_WISE], a=[PGAS_TABLE_WISE])
    if via == "register":
        torchrec_pgas.register()
        planner = EmbeddingShardingPlanner(topology=_topology(world_size), constraints=constraints)
    else:
        planner = make_planner(_topology(world_size), constraints=constraints)
    try:
        with pytest.raises(
            ValueError, match=rf"table 'e0' allow only \['pgas_table_wise'\], but the table is in {kind}"
        ):
            planner.collective_plan(model, None, dist.GroupMember.WORLD)
        # Another type allowed beside it: planned, the PGAS type where it can go.
        constraints["e0"] = ParameterConstraints(sharding_types=[PGAS_TABLE_WISE, TW])
        plan = planner.collective_plan(model, None, dist.GroupMember.WORLD)
        assert "m" in plan.plan
        assert plan.plan["b"]["a"].sharding_type == PGAS_TABLE_WISE
        # TorchRec's own EBC sharder given: the message says to give ours.
        with pytest.raises(ValueError, match=r"table 'a' .* shard it with PgasEmbeddingBagCollectionSharder"):
            planner.collective_plan(model.b, [EmbeddingBagCollectionSharder()], dist.GroupMember.WORLD)
    finally:
        torchrec_pgas.unregister()


@pytest.mark.parametrize("via", ["register", "make_planner"])
@pytest.mark.parametrize("kind", ["EmbeddingCollection", "FeatureProcessedEmbeddingBagCollection"])
def test_pgas_types_for_tables_of_other_modules_raise_on_every_rank(kind, via):
    """Before, rank 0 raised TorchRec's "No available sharding type" in ``collective_plan``
    and the other ranks waited for its plan."""
    from dist_utils import run_ranks

    run_ranks(_unshardable_by_pgas, 2, kind=kind, via=via, deadline_s=120)
