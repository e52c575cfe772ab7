"""Receives a step's ids slots: waits for every source's slot, keeps the step's slot
headers, and lays out the bags of the owner's lookup batch as bag offsets.

The owner pools one batch for all its sources, feature-major, then source, then
sample: bag ``(f, s, b)`` is bag ``(f * S + s) * batch_capacity + b``. Bags past a
source's batch size, and every bag of a source whose header is not ``OK`` (or whose
slot did not arrive in time), are empty. The wait, the headers and the layout are one
launch because a step's time is the host's: a launch, or torch's cumulative sum (two
kernels and an occupancy query), costs the host more than the device.

Each program waits for the slots, then takes the next block of ``BLOCK`` bags in
lookup order (a ticket, so that the blocks before its own are held by programs that
already run), publishes its block's total length, adds up the totals of the blocks
before it (spinning until each is published, reading them with volatile loads; they
never wait on a later block) and
writes its bags' cumulative lengths to ``offsets[1:]``. The program with ticket 0 also
writes the headers, the step and ``offsets[0] = 0``; the last one to finish zeroes
``scan`` for the next launch and ticks the ``RECV`` word of the clock.

The step is the clock's ``RECV + 1`` (``step_clock``): it picks the generation of the
mailbox and the signal value to wait for (``per_step`` per step), so that a replayed
CUDA graph receives the next step.

Buffers:
    ids:      uint8 [DEPTH * S * slot_bytes], the ids mailbox: per generation, S slots
              of ``slot_bytes``, each an ``ids_slot`` layout (header, int32 lengths at
              ``lengths_offset``, ...)
    offsets:  int64 [F * S * batch_capacity + 1]  out
    record:   int64 [S * 8 + 5]  out: the S slot headers, in source order, then four
              words left for ``output_take`` to copy the error record into, then the
              step
    step:     int64 [1]  in/out: the clock's ``RECV`` word
    ready:    int64 [S]  this rank's ready signals, one word per source (with WAIT)
    err:      int64 [4]  error record (see ``signals.py``)
    scan:     int64 [2 + programs]  tickets taken, programs finished, then each block's
              total length once published (``PUBLISHED`` set); zero between launches
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, IdsSlotLayout, Status
from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.put_signal import PROGRAMS_PER_PEER
from torchrec_pgas.kernels.signals import WAIT_DATA, last_to_finish, wait_ge
from torchrec_pgas.kernels.step_clock import RECORD_STEP

_OK = tl.constexpr(Status.OK.value)
_RECORD_STEP = tl.constexpr(RECORD_STEP)
#: Set in a block's published total (a total may be zero).
PUBLISHED = tl.constexpr(1 << 62)
BLOCK = 1024
#: Totals of earlier blocks read at once.
LOOK = 256
NUM_WARPS = 4


@triton.jit(
    do_not_specialize=[
        "num_features",
        "num_sources",
        "batch_capacity",
        "slot_bytes",
        "lengths_offset",
        "per_step",
        "timeout_ns",
    ]
)
def bag_offsets_kernel(
    ids_ptr,
    offsets_ptr,
    record_ptr,
    ready_ptr,
    err_ptr,
    scan_ptr,
    step_ptr,
    num_features: tl.int64,
    num_sources: tl.int64,
    batch_capacity: tl.int64,
    slot_bytes: tl.int64,
    lengths_offset: tl.int64,
    per_step: tl.int64,
    timeout_ns: tl.int64,
    WAIT: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    LOOK: tl.constexpr,
    DEPTH: tl.constexpr,
):
    step = tl.load(step_ptr) + 1
    target = step * per_step
    slots_ptr = ids_ptr + (step % DEPTH) * num_sources * slot_bytes
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
    ticket = tl.atomic_add(scan_ptr, 1, sem="relaxed", scope="gpu")
    per_segment = tl.cdiv(batch_capacity, BLOCK)
    blk = ticket % per_segment
    s = (ticket // per_segment) % num_sources
    f = ticket // per_segment // num_sources
    if ticket == 0:
        words = tl.arange(0, WORDS)
        for q in range(num_sources):
            header = (slots_ptr + slot_bytes * q).to(tl.pointer_type(tl.int64), bitcast=True)
            tl.store(record_ptr + q * WORDS + words, tl.load(header + words))
        tl.store(record_ptr + num_sources * WORDS + _RECORD_STEP, step)
        tl.store(offsets_ptr, 0)
    slot = slots_ptr + s * slot_bytes
    header = slot.to(tl.pointer_type(tl.int64), bitcast=True)
    status = tl.load(header)
    batch = tl.load(header + 1)
    b = blk * BLOCK + tl.arange(0, BLOCK)
    mine = f < num_features
    valid = (b < batch) & (status == _OK) & arrived & mine
    lengths = (slot + lengths_offset).to(tl.pointer_type(tl.int32), bitcast=True)
    n = tl.load(lengths + f * batch + b, mask=valid, other=0).to(tl.int64)
    totals = scan_ptr + 2
    tl.atomic_xchg(totals + ticket, tl.sum(n) | PUBLISHED, sem="release", scope="gpu")
    before = tl.sum(n) * 0
    for start in range(0, ticket, LOOK):
        i = start + tl.arange(0, LOOK)
        earlier = i < ticket
        # A total is the only thing read on its publication (flag and total are one
        # word), so volatile loads do: a read-modify-write per total serialized the
        # programs' look-backs on the totals' few cache lines.
        seen = tl.load(totals + i, mask=earlier, other=0, volatile=True)
        while tl.sum((earlier & ((seen & PUBLISHED) == 0)).to(tl.int32)) > 0:
            seen = tl.load(totals + i, mask=earlier, other=0, volatile=True)
        before += tl.sum(tl.where(earlier, seen & ~PUBLISHED, 0))
    bag = (f * num_sources + s) * batch_capacity + b
    tl.store(offsets_ptr + 1 + bag, before + tl.cumsum(n, 0), mask=(b < batch_capacity) & mine)
    # The last program to finish (every look-back done) zeroes the scan state.
    programs = tl.num_programs(0)
    if last_to_finish(scan_ptr + 1, programs):
        for first in range(0, programs, LOOK):
            j = first + tl.arange(0, LOOK)
            tl.store(totals + j, tl.zeros([LOOK], dtype=tl.int64), mask=j < programs)
        tl.store(scan_ptr, 0)
        tl.store(step_ptr, step)


_launcher = Launcher(bag_offsets_kernel)


def _programs(num_features: int, num_sources: int, layout: IdsSlotLayout) -> int:
    return max(num_features, 1) * num_sources * cdiv(layout.batch_capacity, BLOCK)


def scan_state(num_features: int, num_sources: int, layout: IdsSlotLayout, device: torch.device) -> torch.Tensor:
    """The zeroed ``scan`` buffer of ``bag_offsets`` for this many features and sources."""
    return torch.zeros(2 + _programs(num_features, num_sources, layout), dtype=torch.int64, device=device)


def bag_offsets(
    ids: torch.Tensor,
    num_sources: int,
    num_features: int,
    layout: IdsSlotLayout,
    record: torch.Tensor,
    scan: torch.Tensor,
    step: torch.Tensor,
    ready: Optional[torch.Tensor] = None,
    err: Optional[torch.Tensor] = None,
    timeout_ns: int = 0,
) -> torch.Tensor:
    """The lookup's bag offsets over ``num_features`` features of every source slot of
    the next step's generation of ``ids`` (``[depth * S * slot_bytes]`` uint8), once
    ``ready[s]`` has counted the step's puts for every source ``s`` (without
    ``ready``: at once); the slots' headers and the step go to ``record``, and the
    step to ``step`` (the clock's ``RECV`` word)."""
    S = num_sources
    depth = ids.numel() // (S * layout.nbytes)
    offsets = torch.empty(num_features * S * layout.batch_capacity + 1, dtype=torch.int64, device=ids.device)
    wait = ready is not None
    _launcher[(_programs(num_features, S, layout),)](
        ids,
        offsets,
        record,
        ready if wait else record,
        err if wait else record,
        scan,
        step,
        num_features,
        S,
        layout.batch_capacity,
        layout.nbytes,
        layout.lengths_offset,
        PROGRAMS_PER_PEER,
        timeout_ns,
        WAIT=wait,
        WORDS=HEADER_WORDS,
        BLOCK=BLOCK,
        LOOK=LOOK,
        DEPTH=depth,
        num_warps=NUM_WARPS,
    )
    return offsets
