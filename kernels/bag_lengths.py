"""Lays out the bags of an owner's lookup batch and writes their lengths.

The owner pools one batch for all its sources, feature-major, then source, then
sample: bag ``(f, s, b)`` is bag ``(f * S + s) * batch_capacity + b``. Bags past a
source's batch size, and every bag of a source whose header is not ``OK``, are empty.
The lengths go to ``offsets[1:]`` (and ``offsets[0] = 0``), so one cumulative sum
turns them into the lookup's bag offsets.

Buffers:
    slots:    uint8, this step's generation of the ids mailbox: S slots of
              ``slot_bytes``, each an ``ids_slot`` layout (header, int32 lengths at
              ``lengths_offset``, ...)
    offsets:  int64 [F * S * batch_capacity + 1]  out
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher
from torchrec_pgas.sharding.ids_slot import IdsSlotLayout, Status

_OK = tl.constexpr(Status.OK.value)
BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["num_sources", "batch_capacity", "slot_bytes", "lengths_offset"])
def bag_lengths_kernel(
    slots_ptr,
    offsets_ptr,
    num_sources,
    batch_capacity,
    slot_bytes,
    lengths_offset,
    BLOCK: tl.constexpr,
):
    f = tl.program_id(0)
    s = tl.program_id(1)
    blk = tl.program_id(2)
    slot = slots_ptr + s.to(tl.int64) * slot_bytes
    header = slot.to(tl.pointer_type(tl.int64), bitcast=True)
    status = tl.load(header)
    batch = tl.load(header + 1)
    b = blk * BLOCK + tl.arange(0, BLOCK)
    valid = (b < batch) & (status == _OK)
    lengths = (slot + lengths_offset).to(tl.pointer_type(tl.int32), bitcast=True)
    n = tl.load(lengths + f * batch + b, mask=valid, other=0)
    bag = (f * num_sources + s).to(tl.int64) * batch_capacity + b
    tl.store(offsets_ptr + 1 + bag, n.to(tl.int64), mask=b < batch_capacity)
    if (f == 0) & (s == 0) & (blk == 0):
        tl.store(offsets_ptr, 0)


_launcher = Launcher(bag_lengths_kernel)


def bag_offsets(slots: torch.Tensor, num_features: int, layout: IdsSlotLayout) -> torch.Tensor:
    """The lookup's bag offsets over ``num_features`` features of every source slot in
    ``slots`` (``[S * slot_bytes]`` uint8)."""
    S, cap = slots.numel() // layout.nbytes, layout.batch_capacity
    offsets = torch.empty(num_features * S * cap + 1, dtype=torch.int64, device=slots.device)
    grid = (num_features, S, triton.cdiv(cap, BLOCK))
    _launcher[grid](
        slots, offsets, S, cap, layout.nbytes, layout.lengths_offset,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
    offsets[1:].cumsum_(0)
    return offsets
