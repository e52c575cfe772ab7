"""Receives a step's ids slots: waits for every source's slot, keeps the step's slot
headers, and lays out the bags of the owner's lookup batch as bag offsets.

One program, so that receiving is one launch: the host's time per launch, not the
device's, is what a step waits for. The owner pools one batch for all its sources,
feature-major, then source, then sample: bag ``(f, s, b)`` is bag
``(f * S + s) * batch_capacity + b``. Bags past a source's batch size, and every bag of
a source whose header is not ``OK`` (or whose slot did not arrive in time), are empty.
The offsets are the running sum of the bags' lengths, ``BLOCK`` bags at a time.

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

from torchrec_pgas.kernels.launch import Launcher
from torchrec_pgas.kernels.signals import WAIT_DATA, wait_ge
from torchrec_pgas.sharding.ids_slot import HEADER_WORDS, IdsSlotLayout, Status

_OK = tl.constexpr(Status.OK.value)
BLOCK = 4096
NUM_WARPS = 8


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
    num_features,
    num_sources,
    batch_capacity,
    slot_bytes,
    lengths_offset,
    target,
    timeout_ns,
    WAIT: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    arrived = num_sources >= 0
    if WAIT:
        for s in range(num_sources):
            if arrived:
                arrived = wait_ge(ready_ptr + s, target, timeout_ns, err_ptr, s, WAIT_DATA)
        # Every thread reads the slots after the one that waited (acquire) saw them.
        tl.debug_barrier()
    words = tl.arange(0, WORDS)
    for s in range(num_sources):
        header = (slots_ptr + slot_bytes * s).to(tl.pointer_type(tl.int64), bitcast=True)
        tl.store(record_ptr + s * WORDS + words, tl.load(header + words))

    per_feature = num_sources * batch_capacity
    total = num_features.to(tl.int64) * per_feature
    tl.store(offsets_ptr, 0)
    carry = total * 0
    for start in range(0, total, BLOCK):
        bag = start + tl.arange(0, BLOCK)
        in_range = bag < total
        f = bag // per_feature
        src = (bag % per_feature) // batch_capacity
        b = bag % batch_capacity
        slot = slots_ptr + src * slot_bytes
        header = slot.to(tl.pointer_type(tl.int64), bitcast=True)
        status = tl.load(header, mask=in_range, other=-1)
        batch = tl.load(header + 1, mask=in_range, other=0)
        valid = in_range & (b < batch) & (status == _OK) & arrived
        lengths = (slot + lengths_offset).to(tl.pointer_type(tl.int32), bitcast=True)
        n = tl.load(lengths + f * batch + b, mask=valid, other=0).to(tl.int64)
        tl.store(offsets_ptr + 1 + bag, carry + tl.cumsum(n, 0), mask=in_range)
        carry += tl.sum(n, 0)


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
    _launcher[(1,)](
        slots, offsets, record, ready if wait else record, err if wait else record,
        num_features, S, cap, layout.nbytes, layout.lengths_offset, target, timeout_ns,
        WAIT=wait, WORDS=HEADER_WORDS, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
    return offsets
