"""Serving on a world of one GPU: the quantized module's lookup with no exchange.

A model sharded over one rank has every table on that rank and nobody to exchange
with, so its step is the unsharded module's lookup, as TorchRec's own sharding of a
world of one is. ``LocalServing`` serves it so, keeping the GPU exchanges' contract
(``tw_device_exchange``): a step never waits for the device and can be captured in a
CUDA graph; a bad batch (an id out of range, a negative length, lengths that do not
add up, unknown features, missing weights) gets a NaN output and raises
``PgasInputError`` at the start of a later forward or at
``torchrec_pgas.graphs.raise_errors(model, wait=True)``. A batch the host finds bad is
not looked up; one the device finds bad is looked up within bounds (every bag reads
only ids checked against its own table, ``ids_check``) and its output discarded.

A step is three launches, as many as TorchRec's: ``ids_check`` (the exchanges'
validation, which also writes the ids and offsets FBGEMM reads: int32 as TorchRec's
forward hands them, in bounds whatever the batch), FBGEMM's int-N lookup,
and ``local_finish`` (NaN for a bad batch; the step's header into a ring in pinned
host memory, ``step_records``).
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.ids_check import NONE, ids_check
from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, BadDtype, Header, Status, describe
from torchrec_pgas.kernels.local_finish import local_finish
from torchrec_pgas.sharding.exchange import raise_together
from torchrec_pgas.sharding.step_records import Record, StepRecords
from torchrec_pgas.sharding.tw_base import PgasInputError, TwFeature, batch_problem

#: int32 ids and offsets are used where every table's rows and a batch's ids fit.
INT32_LIMIT = 2**31 - 1


class LocalServing:
    """The serving step of a quantized module on a world of one GPU rank: ``lookup``
    (an ``_NBitLookup``: FBGEMM's int-N lookup, its bounds check off) of the module's
    tables, which must form one FBGEMM module, on batches whose features are
    ``features``, in that order (the lookup's). ``dim``: the output's width; ``name``
    names the steps in errors.

    It owns a few words on the device (the verdict of the checks, the step clock) and
    the ring of step records in pinned host memory; nothing to free but what garbage
    collection frees. Listed among the module's exchanges, it answers what
    ``torchrec_pgas.graphs`` asks of one (``raise_errors``, ``step_counters``,
    ``advance``)."""

    def __init__(
        self,
        lookup: object,
        features: Sequence[TwFeature],
        dim: int,
        out_dtype: torch.dtype,
        weighted: bool,
        device: torch.device,
        name: str,
    ) -> None:
        self._lookup = lookup
        self._features = list(features)
        self._keys = [f.name for f in features]
        self._dim, self._out_dtype, self._weighted = dim, out_dtype, weighted
        self._dev, self._name = device, name
        self._num_rows = torch.tensor([f.num_embeddings for f in features], dtype=torch.int64, device=device)
        self._rows_fit = max((f.num_embeddings for f in features), default=0) <= INT32_LIMIT
        self._verdict = torch.full((2,), NONE, dtype=torch.int64, device=device)
        self._clock = torch.zeros(1, dtype=torch.int64, device=device)
        self._records = StepRecords(HEADER_WORDS, device)
        self._step = 0  # steps enqueued, as the host counts them
        self._pending: List[PgasInputError] = []

    @property
    def keys(self) -> List[str]:
        """The features of a batch, in the order it must have them."""
        return list(self._keys)

    def __call__(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """The pooled rows ``[batch, dim]`` of ``kjt`` (NaN for a bad batch), in the
        lookup's column order."""
        self._keep(self._records.make_room(self._step + 1))
        problem = self._host_problem(kjt)
        self._step += 1
        if problem is not None:
            status, detail, batch, rows = problem
            out = torch.empty(rows, self._dim, dtype=self._out_dtype, device=self._dev)
            local_finish(
                out,
                self._verdict,
                self._verdict,
                self._verdict,
                self._num_rows,
                self._clock,
                self._records.ring,
                batch,
                False,
                host_problem=(status, detail),
            )
            return out
        batch = kjt.stride()
        # The kernels read raw pointers: dense tensors.
        values, offsets, lengths = kjt.values().contiguous(), kjt.offsets().contiguous(), kjt.lengths().contiguous()
        weights = kjt.weights_or_none() if self._weighted else None
        if weights is not None:
            weights = weights.to(torch.float32).contiguous()  # FBGEMM's per-sample weights
        # What FBGEMM reads: in bounds whatever the batch, int32 where it fits.
        narrow = self._rows_fit and values.numel() <= INT32_LIMIT
        index_dtype = torch.int32 if narrow else torch.int64
        ids = torch.empty(values.numel(), dtype=index_dtype, device=self._dev)
        safe_offsets = torch.empty(offsets.numel(), dtype=index_dtype, device=self._dev)
        ids_check(values, offsets, lengths, self._num_rows, self._verdict, batch, sanitized=(ids, safe_offsets))
        if batch:
            out = self._lookup(ids, safe_offsets, weights)  # type: ignore[operator]
        else:
            out = torch.empty(0, self._dim, dtype=self._out_dtype, device=self._dev)
        local_finish(
            out,
            self._verdict,
            values,
            offsets,
            self._num_rows,
            self._clock,
            self._records.ring,
            batch,
            weights is not None,
        )
        return out

    def _host_problem(self, kjt: KeyedJaggedTensor) -> Optional[Tuple[Status, Tuple[int, ...], int, int]]:
        """What the host sees wrong with ``kjt`` without reading its data, as
        ``(status, detail, batch size its header reports, rows of its NaN output)``
        (the exchanges' ``batch_problem``), else None."""
        if not isinstance(kjt, KeyedJaggedTensor):
            # Nothing is enqueued yet, and there are no peers to keep in step.
            raise PgasInputError(f"{self._name}: a batch is a KeyedJaggedTensor, not a {type(kjt).__name__}")
        problem = batch_problem(kjt, self._keys)
        if problem is None and self._weighted and kjt.weights_or_none() is None:
            problem = (Status.BAD_DTYPE, (BadDtype.NO_WEIGHTS,), kjt.stride())
        if problem is None and kjt.offsets().numel() != kjt.lengths().numel() + 1:
            problem = (Status.BAD_LENGTHS, (-1,), 0)  # offsets given that the lengths do not match
        if problem is None:
            return None
        status, detail, batch = problem
        try:
            rows = max(0, int(kjt.stride()))
        except Exception:  # noqa: BLE001 (a batch too broken to say its size)
            rows = 0
        return status, detail, batch, rows

    # ------------------------------------------- what graphs ask of an exchange

    def _keep(self, records: Sequence[Record]) -> None:
        for record in records:
            if record.words[0] != Status.OK:
                text = describe(0, Header.decode(record.words[:HEADER_WORDS]), self._features, None)
                self._pending.append(PgasInputError(f"{self._name} step {record.step}: {text}"))

    def raise_errors(self, wait: bool = False) -> None:
        """See ``Exchange.raise_errors``: what the records of finished steps report,
        the first error with the others as notes (each is raised once)."""
        self._keep(self._records.finished(self._step, wait))
        pending, self._pending = self._pending, []
        raise_together(pending)

    def step_counters(self) -> Tuple[int, ...]:
        """See ``Exchange.step_counters``."""
        return (self._step,)

    def advance(self, delta: Sequence[int]) -> None:
        """See ``Exchange.advance``: the device's clock keeps the true count."""
        self._step += delta[0]
        self._records.checked = min(self._records.checked, self._step)

    def before_replay(self) -> None:
        """See ``Exchange.before_replay``: serving reads no optimizer."""
