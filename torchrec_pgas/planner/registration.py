"""Teaches TorchRec's stock planner the PGAS sharding types, reversibly.

TorchRec 1.6 to 1.9 reject sharding types they do not know in a handful of module-level
functions. ``register()`` swaps each for a wrapper that answers for a PGAS type what
the original answers for the TorchRec type it is laid out like (``layout.PGAS_LAYOUTS``)
and defers to the original for everything else:

- ``sharding_plan.calculate_shard_sizes_and_offsets``: shard sizes and offsets;
- ``planner.enumerators.get_partition_by_type``: how the partitioner places shards;
- ``planner.shard_estimators._calculate_shard_io_sizes``: storage and stats io sizes;
- ``planner.stats._get_sharding_type_abbr``: the abbreviation in the stats table;
- ``planner.estimator.estimator.get_embedding_perf_sharding_evaluator``: returns the
  PGAS cost model (``cost_model``) instead of the silent table-wise fallback;
- ``sharding_plan.get_default_sharders``: our EBC sharder instead of TorchRec's, so
  ``DistributedModelParallel(sharders=None)`` and sharder-less planning offer PGAS types;
- ``EmbeddingEnumerator.enumerate`` and ``EmbeddingShardingPlanner.collective_plan``:
  first reject constraints naming unknown types, and (``collective_plan``) allowing
  only PGAS types for a table whose module's sharder offers none (on every rank,
  before rank 0 plans).

Functions are imported by name into other modules (``from ... import f``), so each
``torchrec`` module in ``sys.modules`` holding the original object is patched too, and
on revert every module holding the wrapper (including ones imported meanwhile) gets the
original back. Patches are applied while ``register()`` is in force or a
``scoped_registration()`` block is open, and removed when neither is.
"""

import functools
import inspect
import re
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Tuple

import torchrec
from torchrec.distributed import sharding_plan
from torchrec.distributed.planner import enumerators, shard_estimators, stats
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator import estimator
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner

from torchrec_pgas.compat import check_versions
from torchrec_pgas.planner.constraints import check_constraint_sharding_types, check_constraints_fit_sharders
from torchrec_pgas.planner.cost_model import pgas_perf_evaluator
from torchrec_pgas.planner.layout import PGAS_LAYOUTS, torchrec_layout
from torchrec_pgas.planner.sharders import with_pgas_ebc_sharder

#: TorchRec versions whose planner internals these patches were written against: [low, high).
SUPPORTED_TORCHREC_VERSIONS: Tuple[Tuple[int, int], Tuple[int, int]] = ((1, 6), (1, 10))


@dataclass(frozen=True)
class _Patch:
    """One attribute swapped: ``owner.name`` was ``original``, is now ``replacement``."""

    owner: Any
    name: str
    original: Any
    replacement: Any


_lock = threading.RLock()
_registered = False
_open_scopes = 0
_applied: List[_Patch] = []


def register() -> None:
    """Make TorchRec's stock planner and default sharders understand the PGAS types.

    Idempotent; stays in force until ``unregister()``. Also the ``torchrec.plugins``
    entry point ``pgas``.

    Raises:
        RuntimeError: if the installed TorchRec is outside ``SUPPORTED_TORCHREC_VERSIONS``.
    """
    global _registered
    check_versions()
    _check_torchrec_version()
    with _lock:
        _registered = True
        _sync()


def unregister() -> None:
    """Undo ``register()``: every patched function is TorchRec's original again.

    Idempotent. Patches held by an open ``scoped_registration()`` stay until it closes.
    """
    global _registered
    with _lock:
        _registered = False
        _sync()


def is_registered() -> bool:
    """Whether ``register()`` is in force (open ``scoped_registration()`` blocks aside)."""
    return _registered


@contextmanager
def scoped_registration() -> Iterator[None]:
    """Apply the patches for the duration of the block only (re-entrant).

    While the block runs the patches are process-wide, so other threads see them too;
    TorchRec's own types behave exactly as before, only PGAS types stop being rejected.

    Raises:
        RuntimeError: if the installed TorchRec is outside ``SUPPORTED_TORCHREC_VERSIONS``.
    """
    global _open_scopes
    _check_torchrec_version()
    with _lock:
        _open_scopes += 1
        _sync()
    try:
        yield
    finally:
        with _lock:
            _open_scopes -= 1
            _sync()


def _installed_torchrec_version() -> str:
    return torchrec.__version__


def _check_torchrec_version() -> None:
    found = _installed_torchrec_version()
    (low, high) = SUPPORTED_TORCHREC_VERSIONS
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None or not low <= (int(match[1]), int(match[2])) < high:
        raise RuntimeError(
            f"torchrec_pgas supports torchrec >={low[0]}.{low[1]},<{high[0]}.{high[1]}; found torchrec {found}"
        )


def _sync() -> None:
    wanted = _registered or _open_scopes > 0
    if wanted and not _applied:
        _apply()
    elif not wanted and _applied:
        _revert()


def _apply() -> None:
    functions = [
        (sharding_plan, "calculate_shard_sizes_and_offsets", _laid_out_as_torchrec_type),
        (enumerators, "get_partition_by_type", _laid_out_as_torchrec_type),
        (shard_estimators, "_calculate_shard_io_sizes", _laid_out_as_torchrec_type),
        (stats, "_get_sharding_type_abbr", _with_pgas_abbreviations),
        (estimator, "get_embedding_perf_sharding_evaluator", _with_pgas_cost_model),
        (sharding_plan, "get_default_sharders", _with_pgas_default_sharders),
    ]
    for module, name, wrap in functions:
        original = getattr(module, name)
        _applied.append(_Patch(module, name, original, wrap(original)))
    # collective_plan plans on rank 0 only: check on every rank first, or a bad
    # constraint raises on rank 0 while the others wait in the broadcast.
    for cls, name, wrap in (
        (EmbeddingEnumerator, "enumerate", _checking_constraints),
        (EmbeddingShardingPlanner, "collective_plan", _checking_constraints_and_sharders),
    ):
        original = getattr(cls, name)
        _applied.append(_Patch(cls, name, original, wrap(original)))
    for patch in _applied:
        _swap(patch, patch.original, patch.replacement)


def _revert() -> None:
    for patch in reversed(_applied):
        _swap(patch, patch.replacement, patch.original)
    _applied.clear()


def _swap(patch: _Patch, old: Any, new: Any) -> None:
    """Set ``patch.owner.name`` to ``new``, and every torchrec module global that is ``old``."""
    setattr(patch.owner, patch.name, new)
    if inspect.isclass(patch.owner):
        return
    for module_name, module in list(sys.modules.items()):
        if module_name != "torchrec" and not module_name.startswith("torchrec."):
            continue
        namespace = getattr(module, "__dict__", {})
        for attr, value in list(namespace.items()):
            if value is old:
                namespace[attr] = new


def _laid_out_as_torchrec_type(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` with its ``sharding_type`` argument mapped to the TorchRec layout."""
    position = list(inspect.signature(original).parameters).index("sharding_type")

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "sharding_type" in kwargs:
            kwargs["sharding_type"] = torchrec_layout(kwargs["sharding_type"])
        elif len(args) > position:
            args = (*args[:position], torchrec_layout(args[position]), *args[position + 1 :])
        return original(*args, **kwargs)

    return wrapper


def _with_pgas_abbreviations(original: Callable[[str], str]) -> Callable[[str], str]:
    @functools.wraps(original)
    def wrapper(sharding_type: str) -> str:
        layout = PGAS_LAYOUTS.get(sharding_type)
        return layout.abbreviation if layout else original(sharding_type)

    return wrapper


def _with_pgas_cost_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(sharding_type: str, is_inference: bool = False) -> Any:
        if sharding_type in PGAS_LAYOUTS:
            return pgas_perf_evaluator(sharding_type, is_inference)
        return original(sharding_type, is_inference)

    return wrapper


def _with_pgas_default_sharders(original: Callable[[], List[Any]]) -> Callable[[], List[Any]]:
    @functools.wraps(original)
    def wrapper() -> List[Any]:
        return with_pgas_ebc_sharder(original())

    return wrapper


def _checking_constraints(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        check_constraint_sharding_types(self._constraints)
        return original(self, *args, **kwargs)

    return wrapper


def _checking_constraints_and_sharders(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, module: Any, sharders: Any = None, pg: Any = None) -> Any:
        check_constraint_sharding_types(self._constraints)
        given = sharding_plan.get_default_sharders() if sharders is None else sharders
        check_constraints_fit_sharders(self._constraints, module, given, self._topology.compute_device)
        return original(self, module, sharders, pg)

    return wrapper
