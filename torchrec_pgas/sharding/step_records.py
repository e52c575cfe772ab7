"""How the host learns what a GPU step reported without waiting for the device.

A step's ``output_take`` copies the step's record (every source's slot header, the
transport's error record, the ids step) into an entry of a ring in pinned host
memory, its output step last. The host reads the entries of the steps that have
finished whenever it runs, so a forward never waits for the device; a replayed CUDA
graph writes its entries the same way. A step that reported a problem has NaN outputs
meanwhile (``output_take``), never a result that passes for one.

The exchange keeps what the records report and raises it only between steps
(``Exchange.raise_errors``, which the sharded module calls before a step's first send):
a rank that raised in the middle of a step, after some of its launches and before
others, would leave its peers waiting, or pair its next launches with their next step.
"""

from typing import List, NamedTuple

import torch

from torchrec_pgas.transport import PgasError

#: Steps the host may run ahead of the device before it waits for the oldest one's
#: record (whose entry the next step would overwrite).
RING_ENTRIES = 64


class Record(NamedTuple):
    """An output step's record: every source's header, the error record, the ids step."""

    step: int
    words: List[int]


class StepRecords:
    """The ring of step records of one exchange, and which output steps the host has
    read (``checked``). ``record_words``: the words of a step's record."""

    def __init__(self, record_words: int, device: torch.device, entries: int = RING_ENTRIES) -> None:
        self._words, self._dev = record_words, device
        # int64 [entries, record_words + 1]: per entry a record, then its output step.
        pinned = device.type == "cuda"
        self.ring = torch.zeros(entries, record_words + 1, dtype=torch.int64, pin_memory=pinned)
        # The host reads the ring through numpy, which shares its memory: a read is a
        # load, not a tensor operation.
        self._host = self.ring.numpy()
        self._entries = entries
        self.checked = 0

    def make_room(self, step: int) -> List[Record]:
        """Before output step ``step`` is enqueued: the record of the step whose entry it
        reuses, if still unread, and those before it (waiting for the device)."""
        entries = self._entries
        return self.finished(step - entries, wait=True) if step - entries > self.checked else []

    def finished(self, upto: int, wait: bool) -> List[Record]:
        """The records of output steps ``checked + 1 ... upto``, in order, as far as the
        device has written them (with ``wait``, all of them, after waiting for the
        device); they count as read."""
        records: List[Record] = []
        while self.checked < upto:
            step = self.checked + 1
            entry = self._host[step % self._entries]
            if int(entry[-1]) != step:
                if not wait:
                    break
                if self._dev.type == "cuda":
                    torch.cuda.synchronize(self._dev)
                if int(entry[-1]) != step:
                    raise PgasError(
                        f"the record of output step {step} never came from the device (a captured "
                        f"step that was not replayed, or a replay the exchange was not told of)"
                    )
            # Read before the device may reuse the entry.
            records.append(Record(step, entry[: self._words].tolist()))
            self.checked = step
        return records
