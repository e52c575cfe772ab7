"""Checks of a batch on the host, before TorchRec's input dist touches it: what
TorchRec would crash on, raise on one rank only, or serve wrongly becomes the same
``PgasInputError`` on every rank (``ShardedPgasEmbeddingBagCollection.input_dist``)."""

from typing import List, Optional, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.ids_slot import Status
from torchrec_pgas.sharding.tw_base import dtype_problem, shape_problem


def batch_problem(features: KeyedJaggedTensor, keys: Optional[List[str]], features_needed: List[str]) -> Optional[str]:
    """What TorchRec's input dist would crash on, raise on one rank only, or serve
    wrongly in ``features``, said as "its ...", or None. ``keys``: the features of
    the module's first batch, whose order TorchRec's permute keeps for good (None
    before it); ``features_needed``: the module's. Reads the lengths (their minimum
    and sum), as TorchRec's permute does."""
    got = list(features.keys())
    if len(set(got)) != len(got):
        return f"features {got} name a feature twice"
    if keys is not None and got != keys:
        return f"features {got} are not those of the first batch, in its order: {keys}"
    missing = [f for f in features_needed if f not in got]
    if missing:
        return f"features {got} lack the model's {missing}"
    values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
    for name, tensor in (("values", values), ("lengths", lengths), ("weights", weights)):
        if tensor is not None and tensor.dim() != 1:
            return f"{name} are {tensor.dim()}-D, not 1-D"
    if values.dtype not in (torch.int32, torch.int64):
        return f"ids are {values.dtype}, not integers"
    if lengths.dtype not in (torch.int32, torch.int64):
        return f"lengths are {lengths.dtype}, not integers"
    if weights is not None and not weights.is_floating_point():
        return f"weights are {weights.dtype}, not floating point"
    if weights is not None and weights.numel() != values.numel():
        return f"{weights.numel()} weights are not one per value ({values.numel()} values)"
    if features.variable_stride_per_key():
        return None  # the PGAS exchanges refuse it, on every rank
    if lengths.numel() != len(got) * features.stride():
        return f"{lengths.numel()} lengths are not one per feature and sample ({len(got)} x {features.stride()})"
    if lengths.numel() and int(lengths.min()) < 0:
        first = int(torch.nonzero(lengths < 0)[0, 0])
        return f"lengths are negative (feature '{got[first // features.stride()]}': {int(lengths[first])})"
    if int(lengths.sum()) != values.numel():
        return f"lengths add up to {int(lengths.sum())}, not to the {values.numel()} values"
    return None


def input_problem(features: KeyedJaggedTensor) -> Optional[Tuple[Status, Tuple[int, ...]]]:
    """The problems of ``features`` that a slot header names itself (see
    ``left_to_the_exchange``), as the header reports them."""
    bad_dtype = dtype_problem(features.values(), features.weights_or_none())
    if bad_dtype is not None:
        return Status.BAD_DTYPE, (bad_dtype,)
    shape = shape_problem(features)
    if shape is not None:
        return Status.BAD_LENGTHS, shape
    if not features.variable_stride_per_key() and sum(features.length_per_key()) != features.values().numel():
        return Status.BAD_LENGTHS, (-1,)
    return None


def left_to_the_exchange(features: KeyedJaggedTensor) -> bool:
    """Whether ``features`` has a problem the exchange reports itself, with its own
    message: ids or weights of a wrong dtype, sizes that disagree, lengths that do
    not add up to the values."""
    return input_problem(features) is not None


def empty_batch(keys: List[str], device: torch.device) -> KeyedJaggedTensor:
    """A batch of no samples with the features ``keys`` on ``device``: what a PGAS
    sharding is given in place of a batch it reports a problem for."""
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.empty(0, dtype=torch.int64, device=device),
        lengths=torch.empty(0, dtype=torch.int64, device=device),
        stride=0,
    )
