"""The symmetric GPU memory of one sharding's device exchange, with one owner.

NVSHMEM allocations and frees are collective: every rank must make them in the same
order, so memory cannot simply go when Python drops the last reference (garbage
collectors run at different times on different ranks). ``DeviceBuffers`` therefore
owns every symmetric tensor of an exchange and frees them only in ``close``, which
every rank calls at the same point of its program: explicitly, through the transport
(``NvshmemTransport.reclaim`` for exchanges whose model was garbage collected, and
the transport's own ``close`` at exit).
"""

import weakref
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch

from torchrec_pgas.kernels import step_clock
from torchrec_pgas.kernels.put_signal import PROGRAMS_PER_PEER, put_signal
from torchrec_pgas.kernels.signal_wait import signal_wait
from torchrec_pgas.kernels.signals import WAIT_DATA
from torchrec_pgas.kernels.step_clock import GRAD, RECV, StepRef
from torchrec_pgas.transport.base import PgasError
from torchrec_pgas.transport.mailbox import DEFAULT_DEPTH
from torchrec_pgas.transport.nvshmem import NvshmemTransport

_WAIT_DATA = WAIT_DATA.value
#: What ``close`` takes away: any later use raises (``DeviceBuffers.__getattr__``)
#: instead of reaching freed memory.
_FREED = (
    "ids",
    "ids_ready",
    "ids_free",
    "out",
    "out_count",
    "out_free",
    "grads",
    "grads_count",
    "grads_free",
    "out_staging",
    "grad_staging",
    "ids_slots",
    "grad_view",
    "out_slots",
    "all_ranks",
    "_no_chunks",
)


#: Generations of the gradient slots: one, so that FBGEMM's backward, which reads them
#: in place, reads the same address at every step (a CUDA graph replays its reads).
GRAD_DEPTH = 1

#: Staging parts start at multiples of this many bytes (the put path's vector copies
#: need 16).
_STAGING_ALIGN = 128


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _STAGING_ALIGN) * _STAGING_ALIGN


class Symmetric(NamedTuple):
    """A symmetric tensor and where every rank's copy is in this process."""

    local: torch.Tensor
    peers: torch.Tensor  # int64 [world]: rank q's copy starts at peers[q]


@dataclass(frozen=True)
class BufferSizes:
    """What sizes the buffers (every rank passes the same values, but ``my_grad_dim``).

    Args:
        ids_slot_bytes: one source's ids slot (``IdsSlotLayout.nbytes``).
        out_blocks: blocks of an output slot: 1 when owners store at their columns
            (table-wise), ``world`` when each stores full rows (row-wise partial sums).
        rows: rows per block and per source (``IdsSlotLayout.batch_capacity``).
        out_dim: columns of the output.
        grad_dim: the widest owner's columns, which size a gradient generation.
        my_grad_dim: this rank's columns, which shape its view of the gradient slots.
        dtype: dtype of the output and gradient rows.
    """

    ids_slot_bytes: int
    out_blocks: int
    rows: int
    out_dim: int
    grad_dim: int
    my_grad_dim: int
    dtype: torch.dtype


class DeviceBuffers:
    """The symmetric tensors of one device exchange, ``depth`` generations of each ids
    and output slot (step ``k`` uses generation ``k % depth``: the protocol of
    ``transport/mailbox.py``, with every wait and signal on the device) and
    ``GRAD_DEPTH`` of the gradient slots, and the exchange's step clock. Allocated
    collectively; ``close`` frees them (collective too), and nothing here may be used
    after it.

    ``W`` is the world size, ``D`` the depth, ``R = sizes.rows``, ``E`` the bytes of
    ``sizes.dtype``. In a signal array, word ``q`` is set by rank ``q`` only.

    * ``ids``: uint8 ``[D * W * ids_slot_bytes]``: per generation, one slot per
      source (``IdsSlotLayout``: header, lengths, ids, weights), put by the sources.
    * ``ids_ready``: int64 ``[W]``: word ``q`` counts source ``q``'s put programs
      (``arrived(step)`` once its ids of ``step`` are in).
    * ``ids_free``: int64 ``[W]``: word ``q``, the last step whose ids slot owner
      ``q`` gave back to this rank.
    * ``out`` (``Symmetric``): uint8 ``[D * out_blocks * R * out_dim * E]``: per
      generation, this rank's pooled output ``[out_blocks, R, out_dim]``, stored by
      the owners.
    * ``out_count`` (``Symmetric``): int64 ``[W]``: word ``q`` counts owner ``q``'s
      programs that stored rows for this rank.
    * ``out_free``: int64 ``[W]``: word ``q``, the last step whose output slot
      requester ``q`` gave back to this owner.
    * ``grads`` (``Symmetric``): uint8 ``[GRAD_DEPTH * W * R * grad_dim * E]``: per
      generation, the gradient rows of this owner's lookup, ``[W * R, my_grad_dim]``
      source-major, stored by the requesters; FBGEMM's backward reads them in place
      (``grad_view``).
    * ``grads_count`` (``Symmetric``): int64 ``[W]``: word ``q`` counts requester
      ``q``'s programs that stored gradient rows here.
    * ``grads_free``: int64 ``[W]``: word ``q``, the last step whose gradient slots
      owner ``q`` gave back to this requester.
    * ``err``: int64 ``[4]`` (code, peer, what, target): the transport's error
      record, which every device-side wait of the transport writes; not freed here.
    * ``clock``: int64 ``[step_clock.WORDS]``, local: the steps the device has taken,
      per phase (``kernels/step_clock.py``), which the kernels read and advance.

    Peer address tables, for the kernels that store into peers' memory: ``peers`` of
    each ``Symmetric`` (int64 ``[W]`` on the device), and ``out_free_peers`` and
    ``ids_free_peers`` (host lists), 0 for a peer served by NVSHMEM puts instead
    (``NvshmemTransport.direct``; ``put_path``: this rank has such a peer).
    ``all_ranks``: int32 ``[W]``, ``0 .. W - 1``.

    Staging, for the kernels' put path: the source of a put must be symmetric memory,
    so rows for a peer without a mapping are stored into local symmetric staging and
    put from there. Allocated only where some rank serves some peer by puts
    (``puts_anywhere``, the same on every rank: the allocation is collective), and
    sized alike on every rank; ``None`` otherwise.

    * ``out_staging``: uint8 ``[W * out_staging_bytes]``: part ``q`` is laid out as
      one block of ``q``'s output slot, ``[R, out_dim]`` (``rows_put`` and
      ``lookup_put``, which run in stream order, share it).
    * ``grad_staging``: uint8 ``[W * grad_staging_bytes]``: part ``o`` holds ``R``
      gradient rows of owner ``o``'s columns (``grads_put``).

    Step bookkeeping: ``held`` is the ids step whose slots stay taken after their
    receive, for a lookup that pools straight from them (``hold``, ``release_held``,
    ``hand_over``).

    Why ``close`` is explicit: a free is collective, and garbage collectors do not run
    at the same point on every rank, so dropping the last reference frees nothing
    (``free_when_collected`` only tells the transport, whose ``reclaim`` closes the
    buffers where every rank calls it).
    """

    def __init__(self, transport: NvshmemTransport, sizes: BufferSizes, depth: int = DEFAULT_DEPTH) -> None:
        t, world = transport, transport.world_size
        self.sizes, self.depth = sizes, depth
        self._t, self._me, self._dev = t, t.rank, t.device
        elem = torch.empty((), dtype=sizes.dtype).element_size()
        self.out_slot_bytes = sizes.out_blocks * sizes.rows * sizes.out_dim * elem
        self.grad_slot_bytes = world * sizes.rows * sizes.grad_dim * elem
        self.clock = step_clock.clock(self._dev)
        # The allocation order is part of the collective contract: keep it.
        self.ids = t.symmetric_tensor((depth * world * sizes.ids_slot_bytes,), torch.uint8)
        self.ids_ready = t.symmetric_tensor((world,), torch.int64)
        self.ids_free = t.symmetric_tensor((world,), torch.int64)
        self.out = self._with_peers((depth * self.out_slot_bytes,), torch.uint8)
        self.out_count = self._with_peers((world,), torch.int64)
        self.out_free = t.symmetric_tensor((world,), torch.int64)
        self.grads = self._with_peers((GRAD_DEPTH * self.grad_slot_bytes,), torch.uint8)
        self.grads_count = self._with_peers((world,), torch.int64)
        self.grads_free = t.symmetric_tensor((world,), torch.int64)
        self.out_staging: Optional[torch.Tensor] = None
        self.grad_staging: Optional[torch.Tensor] = None
        self.out_staging_bytes = _aligned(sizes.rows * sizes.out_dim * elem)
        self.grad_staging_bytes = _aligned(sizes.rows * sizes.grad_dim * elem)
        if t.puts_anywhere:
            self.out_staging = t.symmetric_tensor((world * self.out_staging_bytes,), torch.uint8)
            self.grad_staging = t.symmetric_tensor((world * self.grad_staging_bytes,), torch.uint8)
        self.put_path = not all(t.direct)
        self.err = t.err
        self.out_free_peers: List[int] = t.peer_addresses(self.out_free).tolist()
        self.ids_free_peers: List[int] = t.peer_addresses(self.ids_free).tolist()
        self.held: Optional[int] = None
        self._held_step: Optional[StepRef] = None
        self.all_ranks = torch.arange(world, dtype=torch.int32, device=self._dev)
        self._no_chunks = torch.empty(world, 0, 3, dtype=torch.int64, device=self._dev)
        self._views(sizes, elem)
        self._finalizer: Optional[weakref.finalize] = None
        self.owner_id = t.register(self)
        self._closed = False

    def _with_peers(self, shape, dtype) -> Symmetric:
        local = self._t.symmetric_tensor(shape, dtype)
        return Symmetric(local, self._t.peer_addresses(local))

    def _views(self, sizes: BufferSizes, elem: int) -> None:
        """Per generation, every source's ids slots (uint8); the output slots
        ``[D, out_blocks, R, out_dim]``; the gradient ``[W * R, my_grad_dim]``."""
        world, rows, depth = self._t.world_size, sizes.rows, self.depth
        self.ids_slots = [self.ids[self.slot_offset(0, g) : self.slot_offset(world, g)] for g in range(depth)]
        self.out_slots = self.out.local.view(sizes.dtype).view(depth, sizes.out_blocks, rows, sizes.out_dim)
        mine = world * rows * sizes.my_grad_dim * elem
        self.grad_view = self.grads.local[:mine].view(sizes.dtype).view(world * rows, sizes.my_grad_dim)

    def slot_offset(self, source: int, step: int) -> int:
        """Byte offset of ``source``'s ids slot for ``step`` in every rank's ``ids``
        (as ``Mailbox.slot_offset``)."""
        return ((step % self.depth) * self._t.world_size + source) * self.sizes.ids_slot_bytes

    def slots(self, step: int) -> torch.Tensor:
        """Every source's ids slot of ``step`` (uint8, source-major; ``Mailbox.slot``
        for all sources at once)."""
        return self.ids_slots[step % self.depth]

    # ------------------------------------------------ waits and releases (device)

    def skip(self) -> None:
        """Enqueues the receive of the next ids step that nobody will look up: a wait
        until every source's ids are in (as ``Mailbox.wait``), the clock's tick and the
        slots' release."""
        step = step_clock.at(self.clock, RECV, 1)
        signal_wait(
            self.ids_ready,
            self.all_ranks,
            step,
            self.err,
            _WAIT_DATA,
            self._t.timeout_ns,
            per_step=PROGRAMS_PER_PEER,
            tick=True,
        )
        self.release(step_clock.at(self.clock, RECV))

    def release(self, step: StepRef) -> None:
        """Gives every source its ids slot of ``step`` back (as ``Mailbox.release``)."""
        self._signal(self.ids_free, step)

    def hold(self, step: int, ref: StepRef) -> None:
        """Keeps the ids slots of ``step`` (which ``ref`` holds on the device) after its
        receive, for the lookup."""
        self.held, self._held_step = step, ref

    def release_held(self) -> None:
        """Releases the held ids slots (their lookup, or their output, will not come)."""
        if self._held_step is not None:
            self.release(self._held_step)
        self.held = self._held_step = None

    def hand_over(self, step: int) -> bool:
        """Whether the ids slots of ``step`` are still held, which the caller's kernel
        then releases (the hold ends)."""
        if step and step == self.held:
            self.held = self._held_step = None
            return True
        return False

    def wait_grads(self, per_step: int) -> None:
        """Enqueues a wait until every source has stored ``per_step`` gradient programs
        for the next backward step, and the clock's tick of that step."""
        step = step_clock.at(self.clock, GRAD, 1)
        signal_wait(
            self.grads_count.local,
            self.all_ranks,
            step,
            self.err,
            _WAIT_DATA,
            self._t.timeout_ns,
            per_step=per_step,
            tick=True,
        )

    def release_grads(self) -> None:
        """Gives every requester this owner's gradient slots of the last backward step
        back (ordered after the reads of that step's backward)."""
        self._signal(self.grads_free, step_clock.at(self.clock, GRAD))

    def _signal(self, sig: torch.Tensor, step: StepRef) -> None:
        """Sets word ``me`` of ``sig`` at every rank to ``step`` (a put_signal with no
        data: its destination buffer is never written)."""
        put_signal(self.all_ranks, self._no_chunks, self.ids, sig, sig, self.err, self._me, step, 0, self._t.timeout_ns)

    # ------------------------------------------------------------------ lifetime

    def free_when_collected(self, obj: object) -> None:
        """When ``obj`` (the exchange) is garbage collected, hands these buffers to
        the transport, which closes them at its next ``reclaim`` (collective)."""
        self._finalizer = weakref.finalize(obj, self._t.retire, self.owner_id)

    def close(self) -> None:
        """Frees the buffers (collective: every rank calls it at the same point; it
        waits for this rank's queued work and for every rank). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        tensors = [
            self.ids,
            self.ids_ready,
            self.ids_free,
            self.out.local,
            self.out_count.local,
            self.out_free,
            self.grads.local,
            self.grads_count.local,
            self.grads_free,
        ]
        tensors += [x for x in (self.out_staging, self.grad_staging) if x is not None]
        for name in _FREED:
            delattr(self, name)
        self._t.free_tensors(tensors)
        self._t.unregister(self.owner_id)

    def __getattr__(self, name: str):
        # Reached only for an attribute that is missing: one ``close`` took away.
        if name in _FREED:
            raise PgasError(
                f"rank {self._t.rank}: the exchange's GPU buffers were closed (freed); a model "
                f"sharded over them cannot run another step: shard it again"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "DeviceBuffers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
