"""Checks of a batch on the host, before TorchRec's input dist touches it: what
TorchRec would crash on, raise on one rank only, or serve wrongly becomes the same
``PgasInputError`` on every rank (``ShardedPgasEmbeddingBagCollection.input_dist``)."""

import itertools
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

from torchrec_pgas.kernels.ids_slot import BadDtype, Status
from torchrec_pgas.sharding.tw_base import PgasInputError, dtype_problem, shape_problem


def module_batch_problem(
    features: KeyedJaggedTensor, keys: Optional[List[str]], features_needed: List[str]
) -> Optional[str]:
    """What TorchRec's input dist would crash on, raise on one rank only, or serve
    wrongly in ``features``, said as "its ...", or None. ``keys``: the features of
    the module's first batch, whose order TorchRec's permute keeps for good (None
    before it); ``features_needed``: the module's. Reads the lengths' minimum (one
    sync) and ``length_per_key``, which the KJT caches for TorchRec's permute."""
    got = list(features.keys())
    if len(set(got)) != len(got):
        return f"features {got} name a feature twice"
    if keys is not None and got != keys:
        return f"features {got} are not those of the first batch, in its order: {keys}"
    missing = [f for f in features_needed if f not in got]
    if missing:
        return f"features {got} lack the model's {missing}"
    values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
    shape = shape_problem(features)
    if shape is not None and shape[0] == -3:
        return f"values, lengths and weights are not all 1-D (one is {shape[1]}-D)"
    bad_dtype = dtype_problem(values, weights)
    if bad_dtype == BadDtype.IDS_NOT_INTEGERS:
        return f"ids are {values.dtype}, not integers"
    if lengths.dtype not in (torch.int32, torch.int64):
        return f"lengths are {lengths.dtype}, not integers"
    if bad_dtype is not None:
        return f"weights are {weights.dtype if weights is not None else None}, not floating point"
    if shape is not None and shape[0] == -2:
        return f"{shape[1]} weights are not one per value ({shape[2]} values)"
    if features.variable_stride_per_key():
        return None  # the PGAS exchanges refuse it, on every rank
    if shape is not None:
        return f"{lengths.numel()} lengths are not one per feature and sample ({len(got)} x {features.stride()})"
    if lengths.numel() and int(lengths.min()) < 0:
        first = int(torch.nonzero(lengths < 0)[0, 0])
        return f"lengths are negative (feature '{got[first // features.stride()]}': {int(lengths[first])})"
    total = sum(features.length_per_key())
    if total != values.numel():
        return f"lengths add up to {total}, not to the {values.numel()} values"
    return None


def torchrec_batch_problem(features: KeyedJaggedTensor, rows: Dict[str, Tuple[str, int]]) -> Optional[str]:
    """What a module that also runs TorchRec's own sharding types refuses beyond
    ``module_batch_problem`` (which ``features`` passed), before TorchRec's input dist:
    a variable batch per feature (TorchRec's input dist would run other collectives
    for it on that rank alone), then ids out of range of its tables
    (``ids_range_problem``)."""
    if features.variable_stride_per_key():
        return "batch size varies per feature (VBE), which the PGAS sharding types do not support"
    return ids_range_problem(features, rows)


def ids_range_problem(features: KeyedJaggedTensor, rows: Dict[str, Tuple[str, int]]) -> Optional[str]:
    """The first id of a feature in ``rows`` (feature: its table and the table's row
    count) that is not a row of its table, said as "ids ...", or None. For the
    features of TorchRec's own sharding types beside PGAS ones (whose exchanges check
    their own): FBGEMM would serve an id past the table as row 0 and raise for a
    negative one on its owner alone. One read-back; ``features`` passed
    ``module_batch_problem`` and have one batch size for every feature (their lengths
    were checked)."""
    keys, values = features.keys(), features.values()
    if not values.numel() or not any(k in rows for k in keys):
        return None
    lengths = features.length_per_key()
    bounds = torch.tensor([rows[k][1] if k in rows else -1 for k in keys], device=values.device)
    per_value = bounds.repeat_interleave(torch.tensor(lengths, device=values.device), output_size=values.numel())
    bad = (per_value >= 0) & ((values < 0) | (values >= per_value))
    if not bool(bad.any()):
        return None
    first = int(torch.nonzero(bad)[0, 0])
    key = keys[next(i for i, end in enumerate(itertools.accumulate(lengths)) if first < end)]
    table, n = rows[key]
    return (
        f"ids are out of range (id {int(values[first])} for feature '{key}' of table '{table}', "
        f"which has {n} rows: ids must be in [0, {n}))"
    )


def first_batch_problem(features: KeyedJaggedTensor, configs: List[EmbeddingBagConfig]) -> Optional[str]:
    """TorchRec's validation of a module's first batch (which raises on that rank
    alone), said as a problem, else None."""
    if features.variable_stride_per_key():
        return None
    try:
        validate_keyed_jagged_tensor(features, configs)
    except Exception as e:
        return f"keys, lengths or offsets fail TorchRec's validation ({e})"
    return None


def raise_on_every_rank(pg: dist.ProcessGroup, problem: Optional[str]) -> None:
    """Raises the same ``PgasInputError`` on every rank of ``pg`` if any rank has a
    ``problem``: one all_reduce of one number, and a gather of the messages if any."""
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")
    )
    flag = torch.tensor([int(problem is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    if not int(flag.item()):
        return
    everyone: List[Optional[str]] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, problem, group=pg)
    raise PgasInputError("; ".join(f"rank {r} sent a batch whose {p}" for r, p in enumerate(everyone) if p is not None))


def input_problem(features: KeyedJaggedTensor) -> Optional[Tuple[Status, Tuple[int, ...]]]:
    """The problems of ``features`` that a slot header names itself, as the header
    reports them: ids or weights of a wrong dtype, sizes that disagree, lengths that
    do not add up to the values. The exchange reports these with its own message."""
    bad_dtype = dtype_problem(features.values(), features.weights_or_none())
    if bad_dtype is not None:
        return Status.BAD_DTYPE, (bad_dtype,)
    shape = shape_problem(features)
    if shape is not None:
        return Status.BAD_LENGTHS, shape
    if not features.variable_stride_per_key() and sum(features.length_per_key()) != features.values().numel():
        return Status.BAD_LENGTHS, (-1,)
    return None


def empty_batch(keys: List[str], device: torch.device) -> KeyedJaggedTensor:
    """A batch of no samples with the features ``keys`` on ``device``: what a PGAS
    sharding is given in place of a batch it reports a problem for."""
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.empty(0, dtype=torch.int64, device=device),
        lengths=torch.empty(0, dtype=torch.int64, device=device),
        stride=0,
    )


T = TypeVar("T")


class ProblemReporter(Protocol):
    """A PGAS sharding or exchange: its next send reports a problem in place of a batch."""

    def report_input_problem(self, status: Optional[Status], detail: Optional[Tuple[Any, ...]]) -> None: ...


def send_problem(
    reporter: ProblemReporter,
    features: KeyedJaggedTensor,
    problem: str,
    keys: Sequence[str],
    send: Callable[[KeyedJaggedTensor], T],
) -> T:
    """Sends ``problem`` of ``features`` in place of the batch, through ``send``
    given an empty batch of the features ``keys``: as the slot header's status where
    one names it, else as a message. Every rank then raises for this step, where it
    receives it, rather than some ranks serving a batch their peers never sent."""
    reporter.report_input_problem(*(input_problem(features) or (Status.FAILED, (f"its {problem}",))))
    try:
        return send(empty_batch(list(keys), features.device()))
    finally:
        # The send took the report; one that failed before sending must not pass it
        # on to the next batch.
        reporter.report_input_problem(None, None)
