"""Gathers the ids (and weights) of every source's slot into one lookup group's batch.

The bags are laid out as ``bag_offsets`` says; ``offsets`` are the whole batch's.
A lookup group holds features ``[first_feature, first_feature + F)``; its index
tensor starts at the first of its bags. Program ``(f, s, c)`` copies share ``c`` of
``SPLIT`` of the ids of feature ``first_feature + f`` of source ``s``, so the copy
uses the whole GPU however few features and sources there are. The slots are those of
the generation of the step in ``step`` (``step_clock``: the step's record).

Buffers:
    ids:       uint8 [DEPTH * S * slot_bytes], the ids mailbox: per generation, S
               slots of ``slot_bytes``, ids (int64) at ``ids_offset`` and weights
               (float32) at ``weights_offset`` of each slot, feature-major
    step:      int64 [1]  the ids step
    offsets:   int64 [num_features * S * batch_capacity + 1]  the batch's bag offsets
    indices:   int64 or int32 [>= the group's ids]   out (int32: the ids fit it)
    weights:   float32 [>= the group's ids] out (only with HAS_WEIGHTS)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.ids_slot import IdsSlotLayout
from torchrec_pgas.kernels.launch import Launcher

BLOCK = 1024
SPLIT = 32
NUM_WARPS = 4


@triton.jit(
    do_not_specialize=["first_feature", "num_sources", "batch_capacity", "slot_bytes", "ids_offset", "weights_offset"]
)
def gather_ids_kernel(
    ids_ptr,
    step_ptr,
    offsets_ptr,
    indices_ptr,
    weights_ptr,
    first_feature: tl.int64,
    num_sources: tl.int64,
    batch_capacity: tl.int64,
    slot_bytes: tl.int64,
    ids_offset: tl.int64,
    weights_offset: tl.int64,
    HAS_WEIGHTS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    DEPTH: tl.constexpr,
):
    slots_ptr = ids_ptr + (tl.load(step_ptr) % DEPTH) * num_sources * slot_bytes
    f = first_feature + tl.program_id(0)
    s = tl.program_id(1)
    c = tl.program_id(2)
    S = num_sources
    bag = (f * S + s).to(tl.int64) * batch_capacity
    start = tl.load(offsets_ptr + bag)
    n = tl.load(offsets_ptr + bag + batch_capacity) - start
    # A slot holds its source's ids feature-major: feature f's come after the earlier
    # features' of that source.
    first = start - start
    for g in range(0, f):
        g_bag = (g * S + s).to(tl.int64) * batch_capacity
        first += tl.load(offsets_ptr + g_bag + batch_capacity) - tl.load(offsets_ptr + g_bag)
    dst = start - tl.load(offsets_ptr + first_feature * S * batch_capacity)
    share = tl.cdiv(n, SPLIT)
    lo = c * share
    hi = tl.minimum(lo + share, n)
    slot = slots_ptr + s.to(tl.int64) * slot_bytes
    ids = (slot + ids_offset).to(tl.pointer_type(tl.int64), bitcast=True) + first
    w = (slot + weights_offset).to(tl.pointer_type(tl.float32), bitcast=True) + first
    for i in range(lo, hi, BLOCK):
        k = i + tl.arange(0, BLOCK)
        mask = k < hi
        tl.store(indices_ptr + dst + k, tl.load(ids + k, mask=mask), mask=mask)
        if HAS_WEIGHTS:
            tl.store(weights_ptr + dst + k, tl.load(w + k, mask=mask), mask=mask)


_launcher = Launcher(gather_ids_kernel)


def gather_ids(
    ids: torch.Tensor,
    step: torch.Tensor,
    num_sources: int,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    first_feature: int,
    num_features: int,
    layout: IdsSlotLayout,
    has_weights: bool,
) -> None:
    """Launches ``(num_features, S, SPLIT)`` programs (see the module docstring)."""
    S = num_sources
    if num_features == 0 or S == 0:
        return
    _launcher[(num_features, S, SPLIT)](
        ids,
        step,
        offsets,
        indices,
        weights,
        first_feature,
        S,
        layout.batch_capacity,
        layout.nbytes,
        layout.ids_offset,
        layout.weights_offset,
        HAS_WEIGHTS=has_weights,
        SPLIT=SPLIT,
        BLOCK=BLOCK,
        DEPTH=ids.numel() // (S * layout.nbytes),
        num_warps=NUM_WARPS,
    )
