"""Gathers the ids (and weights) of every source's slot into one lookup batch.

The owner's lookup pools a batch laid out feature-major, then source, then sample:
bag ``(f, s, b)`` is bag ``(f * S + s) * batch_capacity + b`` and its ids start at
``offsets`` of that bag. Program ``(f, s)`` copies the ids of feature ``f`` of source
``s`` from that source's slot into place.

Buffers:
    slots:        uint8, this step's generation of the ids mailbox: S slots of
                  ``slot_bytes``, ids (int64) at ``ids_offset`` and weights (float32)
                  at ``weights_offset`` of each slot
    slot_starts:  int64 [S, F]  where feature f's ids start among source s's ids
    counts:       int64 [F, S]  how many ids feature f of source s has
    offsets:      int64 [F * S * batch_capacity + 1]  the lookup's bag offsets
    indices:      int64 [capacity]   out
    weights:      float32 [capacity] out (only with HAS_WEIGHTS)
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["slot_bytes", "ids_offset", "weights_offset", "batch_capacity"])
def gather_ids_kernel(
    slots_ptr,
    slot_starts_ptr,
    counts_ptr,
    offsets_ptr,
    indices_ptr,
    weights_ptr,
    slot_bytes,
    ids_offset,
    weights_offset,
    batch_capacity,
    S: tl.constexpr,
    F: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    f = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.load(counts_ptr + f * S + s)
    first = tl.load(slot_starts_ptr + s * F + f)
    dst = tl.load(offsets_ptr + (f * S + s).to(tl.int64) * batch_capacity)
    slot = slots_ptr + s.to(tl.int64) * slot_bytes
    ids = (slot + ids_offset).to(tl.pointer_type(tl.int64), bitcast=True) + first
    w = (slot + weights_offset).to(tl.pointer_type(tl.float32), bitcast=True) + first
    for i in range(0, n, BLOCK):
        k = i + tl.arange(0, BLOCK)
        mask = k < n
        tl.store(indices_ptr + dst + k, tl.load(ids + k, mask=mask), mask=mask)
        if HAS_WEIGHTS:
            tl.store(weights_ptr + dst + k, tl.load(w + k, mask=mask), mask=mask)


def gather_ids(
    slots: torch.Tensor,
    slot_starts: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    slot_bytes: int,
    ids_offset: int,
    weights_offset: int,
    batch_capacity: int,
    has_weights: bool,
) -> None:
    """Launches one program per (feature, source) (see the module docstring)."""
    F, S = counts.shape
    if F == 0 or S == 0:
        return
    gather_ids_kernel[(F, S)](
        slots, slot_starts, counts, offsets, indices, weights,
        slot_bytes, ids_offset, weights_offset, batch_capacity,
        S=S, F=F, HAS_WEIGHTS=has_weights, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
