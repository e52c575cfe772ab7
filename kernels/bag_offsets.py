"""Receives a step's ids slots: waits for every source's slot, keeps the step's slot
headers, and lays out the bags of the owner's lookup batch as bag offsets.

The owner pools one batch for all its sources, feature-major, then source, then
sample: bag ``(f, s, b)`` is bag ``(f * S + s) * batch_capacity + b``. Bags past a
source's batch size, and every bag of a source whose header is not ``OK`` (or whose
slot did not arrive in time), are empty. Program ``(f, s, blk)`` waits for the slots,
then writes the lengths of bags ``blk * BLOCK ...`` of feature ``f`` and source ``s`` to
``offsets[1:]`` (program ``(0, 0, 0)`` also the headers and ``offsets[0] = 0``), and one
cumulative sum turns them into the lookup's bag offsets. The wait, the headers and the
layout are one launch because a step's time is the host's: a launch costs the host
more than the device.

Buffers:
    slots:    uint8, this step's generation of the ids mailbox: S slots of
              ``slot_bytes``, each an ``ids_slot`` layout (header, int32 lengths at
              ``lengths_offset``, ...)
    offsets:  int64 [F * S * batch_capacity + 1]  out
    record:   int64 [S * 8 + 4]  out: the S slot headers, in source order (the last
              four words are left for ``signal_wait`` to copy the error record into)
    ready:    int64 [S]  this rank's ready signals, one word per source (with WAIT)
    err:      int64 [4]  error record (see ``signals.py``)
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.signals import WAIT_DATA, wait_ge
from torchrec_pgas.sharding.ids_slot import HEADER_WORDS, IdsSlotLayout, Status

_OK = tl.constexpr(Status.OK.value)
BLOCK = 1024
NUM_WARPS = 4


@triton.jit(
    do_not_specialize=[
        "num_features", "num_sources", "batch_capacity", "slot_bytes", "lengths_offset", "target", "timeout_ns",
    ]
)
def bag_offsets_kernel(
    slots_ptr,
    offsets_ptr,
    record_ptr,
    ready_ptr,
    err_ptr,
    num_features: tl.int64,
    num_sources: tl.int64,
    batch_capacity: tl.int64,
    slot_bytes: tl.int64,
    lengths_offset: tl.int64,
    target: tl.int64,
    timeout_ns: tl.int64,
    WAIT: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    f = tl.program_id(0)
    s = tl.program_id(1)
    blk = tl.program_id(2)
    arrived = num_sources >= 0
    if WAIT:
        for q in range(num_sources):
            if arrived:
                # After a wait that timed out (another program's, or an earlier step's
                # not yet reported), spin no more: the grid's programs would otherwise
                # time out wave after wave.
                arrived = tl.atomic_add(err_ptr, 0, sem="acquire", scope="gpu") == 0
            if arrived:
                arrived = wait_ge(ready_ptr + q, target, timeout_ns, err_ptr, q, WAIT_DATA)
        # Every thread reads the slots after the one that waited (acquire) saw them.
        tl.debug_barrier()
    if (f == 0) & (s == 0) & (blk == 0):
        words = tl.arange(0, WORDS)
        for q in range(num_sources):
            header = (slots_ptr + slot_bytes * q).to(tl.pointer_type(tl.int64), bitcast=True)
            tl.store(record_ptr + q * WORDS + words, tl.load(header + words))
        tl.store(offsets_ptr, 0)
    slot = slots_ptr + s.to(tl.int64) * slot_bytes
    header = slot.to(tl.pointer_type(tl.int64), bitcast=True)
    status = tl.load(header)
    batch = tl.load(header + 1)
    b = blk * BLOCK + tl.arange(0, BLOCK)
    mine = f < num_features
    valid = (b < batch) & (status == _OK) & arrived & mine
    lengths = (slot + lengths_offset).to(tl.pointer_type(tl.int32), bitcast=True)
    n = tl.load(lengths + f * batch + b, mask=valid, other=0)
    bag = (f * num_sources + s).to(tl.int64) * batch_capacity + b
    tl.store(offsets_ptr + 1 + bag, n.to(tl.int64), mask=(b < batch_capacity) & mine)


_launcher = Launcher(bag_offsets_kernel)


def bag_offsets(
    slots: torch.Tensor,
    num_features: int,
    layout: IdsSlotLayout,
    record: torch.Tensor,
    ready: Optional[torch.Tensor] = None,
    target: int = 0,
    err: Optional[torch.Tensor] = None,
    timeout_ns: int = 0,
) -> torch.Tensor:
    """The lookup's bag offsets over ``num_features`` features of every source slot in
    ``slots`` (``[S * slot_bytes]`` uint8), once ``ready[s] >= target`` for every
    source ``s`` (without ``ready``: at once); the slots' headers go to ``record``."""
    S, cap = slots.numel() // layout.nbytes, layout.batch_capacity
    offsets = torch.empty(num_features * S * cap + 1, dtype=torch.int64, device=slots.device)
    wait = ready is not None
    grid = (max(num_features, 1), S, cdiv(cap, BLOCK))
    _launcher[grid](
        slots, offsets, record, ready if wait else record, err if wait else record,
        num_features, S, cap, layout.nbytes, layout.lengths_offset, target, timeout_ns,
        WAIT=wait, WORDS=HEADER_WORDS, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
    offsets[1:].cumsum_(0)
    return offsets
