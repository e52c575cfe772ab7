"""Step-numbered mailboxes with flow control, built on any ``Transport``.

A mailbox is a symmetric buffer of ``depth`` generations of slots plus two signal
arrays. A sender writes step ``k`` into generation ``k % depth`` of the receiver's
buffer and signals ``ready[sender] = k`` there; the receiver, once it has read the
data, signals ``free[receiver] = k`` back at the sender. Before writing step ``k``
a sender waits for ``free >= k - depth``, so a slot is never overwritten while its
reader still needs it, however far a pipeline (``TrainPipelineSparseDist``) runs
ahead. Signals carry step numbers, so nothing is ever reset between steps.

With ``per_source=True`` every sender has its own slot per generation (ids, lengths,
gradients). With ``per_source=False`` all senders share one slot per generation and
write disjoint parts of it (pooled rows at their final column block).
"""

from torchrec_pgas.transport.base import Transport

DEFAULT_DEPTH = 2


class Mailbox:
    """Per-step slots that peers put into and this rank reads.

    Args:
        transport: the transport that allocates (collectively) and moves the data.
        slot_bytes: size of one slot; every rank passes the same value.
        per_source: whether each sender has a slot of its own (see module docstring).
        name: used in timeout messages, e.g. ``"pgas_table_wise ids"``.
        depth: number of generations of slots.
    """

    def __init__(
        self,
        transport: Transport,
        slot_bytes: int,
        per_source: bool,
        name: str,
        depth: int = DEFAULT_DEPTH,
    ) -> None:
        self.transport = transport
        self.slot_bytes = slot_bytes
        self.name = name
        self._per_source = per_source
        self._depth = depth
        world = transport.world_size
        slots = depth * (world if per_source else 1)
        self.buffer = transport.alloc(slots * slot_bytes)
        self._ready = transport.alloc_signals(world)
        self._free = transport.alloc_signals(world)

    def slot_offset(self, source: int, step: int) -> int:
        """Byte offset of ``source``'s slot for ``step`` in every rank's buffer."""
        generation = step % self._depth
        if self._per_source:
            return (generation * self.transport.world_size + source) * self.slot_bytes
        return generation * self.slot_bytes

    def begin_send(self, peer: int, step: int) -> int:
        """Waits until ``peer`` has released the slot ``step`` reuses; returns the
        byte offset of this rank's slot for ``step`` in ``peer``'s buffer. The exchange
        checks that the process group is alive once per step, before its first send."""
        t = self.transport
        if step > self._depth:
            t.wait(
                self._free,
                peer,
                step - self._depth,
                f"rank {peer} to release its {self.name} slot of step {step - self._depth}",
            )
        return self.slot_offset(t.rank, step)

    def end_send(self, peer: int, step: int) -> None:
        """Tells ``peer`` that this rank's data for ``step`` is in place."""
        self.transport.signal(self._ready, peer, self.transport.rank, step)

    def wait(self, source: int, step: int) -> None:
        """Waits until ``source``'s data for ``step`` is in this rank's buffer."""
        self.transport.wait(self._ready, source, step, f"{self.name} of step {step} from rank {source}")

    def slot(self, source: int, step: int):
        """This rank's bytes of ``source``'s slot for ``step`` (a uint8 tensor view)."""
        offset = self.slot_offset(source, step)
        return self.buffer.local[offset : offset + self.slot_bytes]

    def release(self, source: int, step: int) -> None:
        """Tells ``source`` that this rank is done with its slot of ``step``."""
        self.transport.signal(self._free, source, self.transport.rank, step)

    def close(self) -> None:
        for obj in (self.buffer, self._ready, self._free):
            self.transport.free(obj)
