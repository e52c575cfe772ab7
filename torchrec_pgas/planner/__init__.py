"""Planner support for the PGAS sharding types: cost model, registration, planner."""

from torchrec_pgas.planner.cost_model import (
    SIGNAL_LATENCY_MS,
    PgasTableWiseEvaluator,
    pgas_perf_evaluator,
)
from torchrec_pgas.planner.layout import PGAS_LAYOUTS, PgasLayout, torchrec_layout
from torchrec_pgas.planner.registration import (
    is_registered,
    register,
    scoped_registration,
    unregister,
)
from torchrec_pgas.planner.sharders import pgas_sharders
from torchrec_pgas.planner.sharding_planner import PgasShardingPlanner, make_planner

__all__ = [
    "PGAS_LAYOUTS",
    "PgasLayout",
    "PgasShardingPlanner",
    "PgasTableWiseEvaluator",
    "SIGNAL_LATENCY_MS",
    "is_registered",
    "make_planner",
    "pgas_perf_evaluator",
    "pgas_sharders",
    "register",
    "scoped_registration",
    "torchrec_layout",
    "unregister",
]
