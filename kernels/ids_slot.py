"""Layout of one source's slot of ids in an owner's receive buffer.

A slot holds one step of one source's features for one owner::

    header   int64[8]                 status, batch size, number of ids, has weights,
                                      three words of detail (see ``Status``), padding
    lengths  int32[max_features * batch_capacity]   feature-major, like a KJT
    ids      int64[ids_capacity]                    feature-major, like a KJT
    weights  float32[ids_capacity]                  per-sample weights, if any

Every source writes a slot to every rank at every step, even an empty one, so every
rank learns of a bad batch from the same headers and raises the same error.
"""

import functools
import math
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    from torchrec_pgas.types import PgasOptions

HEADER_WORDS = 8

#: The least capacity of a slot, whatever the first batch: a tiny, empty or refused
#: first batch (a warm-up, a smoke test) must not size the buffers for good at a few
#: samples. A slot of this size is about 100 KB per source and owner.
MIN_BATCH_CAPACITY = 128
MIN_IDS_CAPACITY = 8192


class Status(IntEnum):
    """What a source reports in a slot header, with the meaning of the detail words."""

    OK = 0
    #: detail = (feature index in the sharding, offending id, number of rows)
    ID_OUT_OF_RANGE = 1
    #: detail = (batch size, most ids for one owner, 0)
    OVER_CAPACITY = 2
    #: detail = (feature index with a negative length, or -1 when the lengths do not
    #: add up to the number of values or to features x batch size, or -2 when the
    #: weights are not one per value: then (-2, number of weights, number of values),
    #: or -3 when the values, lengths or weights are not 1-D: then (-3, their dims))
    BAD_LENGTHS = 3
    #: the KJT has a variable batch size per feature (VBE), which is not supported
    VARIABLE_BATCH = 4
    #: detail = (a ``BadDtype``)
    BAD_DTYPE = 5
    #: the batch's features are not the plan's; detail = (first position that differs,
    #: features sent, features expected)
    UNKNOWN_FEATURES = 6
    #: the source could not prepare its batch (any other error, or a problem the sharded
    #: module found); detail = (bytes of the message, 0, 0): the message, UTF-8, fills
    #: the slot after the header, so every rank can raise with it
    FAILED = 7


class BadDtype(IntEnum):
    """What ``Status.BAD_DTYPE`` reports."""

    IDS_NOT_INTEGERS = 0
    WEIGHTS_NOT_FLOATING = 1
    NO_WEIGHTS = 2


@dataclass
class Header:
    status: Status
    batch_size: int
    num_ids: int
    has_weights: bool
    detail: tuple

    def encode(self) -> torch.Tensor:
        words = [int(self.status), self.batch_size, self.num_ids, int(self.has_weights)]
        words += list(self.detail) + [0] * (HEADER_WORDS - 4 - len(self.detail))
        return torch.tensor(words, dtype=torch.int64)

    @staticmethod
    def decode(words: "torch.Tensor | Sequence[int]") -> "Header":
        w = words.tolist() if isinstance(words, torch.Tensor) else list(words)
        return Header(Status(w[0]), w[1], w[2], bool(w[3]), tuple(w[4:7]))


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


@dataclass(frozen=True)
class Capacity:
    """How slots are sized from the first batch (``PgasOptions.headroom`` and
    ``max_batch_size``): ``headroom`` times it, or ``max_batch`` samples with
    ``headroom`` times its ids per sample."""

    headroom: float = 2.0
    max_batch: Optional[int] = None

    @staticmethod
    def of(options: "PgasOptions") -> "Capacity":
        """The sizing ``options`` ask for."""
        return Capacity(options.headroom, options.max_batch_size)


@dataclass(frozen=True)
class IdsSlotLayout:
    """Byte offsets of the parts of a slot, for given capacities (computed once: every
    launch reads them)."""

    max_features: int
    batch_capacity: int
    ids_capacity: int

    @staticmethod
    def for_batch(
        max_features: int,
        batch_size: int,
        num_ids: int,
        capacity: Capacity,
        ids_per_sample: Optional[int] = None,
        min_batch: int = MIN_BATCH_CAPACITY,
        min_ids: int = MIN_IDS_CAPACITY,
    ) -> "IdsSlotLayout":
        """Capacities ``capacity.headroom`` times the given batch (its largest size and
        id count), or ``capacity.max_batch`` samples and ``headroom`` times
        ``ids_per_sample`` ids for each (default ``num_ids / batch_size``; give the
        largest of the ranks' own ratios: the largest batch and id count may be two
        ranks') where that is more; at least ``min_batch`` samples and ``min_ids`` ids."""
        headroom, samples_headroom = capacity.headroom, capacity.headroom
        if capacity.max_batch is not None and capacity.max_batch > batch_size * headroom:
            if ids_per_sample is None:
                ids_per_sample = math.ceil(num_ids / batch_size) if batch_size else 0
            batch_size, num_ids = capacity.max_batch, max(num_ids, ids_per_sample * capacity.max_batch)
            samples_headroom = 1.0  # the largest batch is known: only its ids per sample vary
        return IdsSlotLayout(
            max_features=max_features,
            batch_capacity=max(math.ceil(batch_size * samples_headroom), min_batch, 1),
            ids_capacity=max(math.ceil(num_ids * headroom), min_ids, 1),
        )

    @functools.cached_property
    def lengths_offset(self) -> int:
        return HEADER_WORDS * 8

    @functools.cached_property
    def ids_offset(self) -> int:
        return self.lengths_offset + _align8(4 * self.max_features * self.batch_capacity)

    @functools.cached_property
    def weights_offset(self) -> int:
        return self.ids_offset + 8 * self.ids_capacity

    @functools.cached_property
    def nbytes(self) -> int:
        return self.weights_offset + _align8(4 * self.ids_capacity)

    def fits(self, batch_size: int, num_ids: int) -> bool:
        return batch_size <= self.batch_capacity and num_ids <= self.ids_capacity

    def header(self, slot: torch.Tensor) -> Header:
        return Header.decode(slot[: self.lengths_offset].view(torch.int64))

    def lengths(self, slot: torch.Tensor, count: int) -> torch.Tensor:
        return slot[self.lengths_offset : self.lengths_offset + 4 * count].view(torch.int32)

    def ids(self, slot: torch.Tensor, count: int) -> torch.Tensor:
        return slot[self.ids_offset : self.ids_offset + 8 * count].view(torch.int64)

    def weights(self, slot: torch.Tensor, count: int) -> torch.Tensor:
        return slot[self.weights_offset : self.weights_offset + 4 * count].view(torch.float32)

    def encode_text(self, message: str) -> torch.Tensor:
        """``message`` as ``Status.FAILED`` carries it after the header (cut to fit)."""
        data = message.encode("utf-8")[: self.nbytes - self.lengths_offset]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def text(self, slot: torch.Tensor, nbytes: int) -> str:
        """The message of a ``Status.FAILED`` slot."""
        data = slot[self.lengths_offset : self.lengths_offset + min(nbytes, self.nbytes - self.lengths_offset)]
        return bytes(data.cpu().tolist()).decode("utf-8", errors="replace")


def describe(source: int, header: Header, features: Sequence, layout: Optional[IdsSlotLayout], text: str = "") -> str:
    """The message for a header whose status is not ``OK`` (``features`` are the
    sharding's ``TwFeature`` in order; ``text`` is a ``Status.FAILED`` slot's message;
    ``layout``, the slots' capacities, is read for ``Status.OVER_CAPACITY``)."""
    d = header.detail
    if header.status == Status.FAILED:
        return f"rank {source} could not send its batch: {text or '(see that rank)'}"
    if header.status == Status.ID_OUT_OF_RANGE:
        f = features[d[0]]
        return (
            f"rank {source} sent id {d[1]} for feature '{f.name}' of table '{f.table}', "
            f"which has {d[2]} rows (ids must be in [0, {d[2]}))"
        )
    if header.status == Status.OVER_CAPACITY:
        assert layout is not None, "an over-capacity batch is reported by a sharding with slots"
        said = f"rank {source}'s batch ({d[0]} samples, up to {d[1]} ids for one rank) is over capacity"
        if d[0] > layout.batch_capacity:
            return (
                f"{said}: the slots take {layout.batch_capacity} samples (the first batch's times "
                f"PgasOptions.headroom, at least {MIN_BATCH_CAPACITY}): set PgasOptions.max_batch_size to "
                f"the largest batch, or make the first batch the largest"
            )
        return (
            f"{said}: the slots take {layout.ids_capacity} ids (PgasOptions.headroom times the first "
            f"batch's ids, or its ids per sample for max_batch_size samples; at least "
            f"{MIN_IDS_CAPACITY}): raise headroom, or make the first batch the one with the most ids"
        )
    if header.status == Status.BAD_LENGTHS and d[0] == -3:
        return f"rank {source} sent a KJT whose values, lengths or weights are not 1-D ({d[1]} dimensions)"
    if header.status == Status.BAD_LENGTHS and d[0] == -2:
        return f"rank {source} sent a KJT whose weights and values disagree ({d[1]} weights for {d[2]} values)"
    if header.status == Status.BAD_LENGTHS:
        where = f" (negative length in feature '{features[d[0]].name}')" if d[0] >= 0 else ""
        return f"rank {source} sent a KJT whose lengths and values disagree{where}"
    if header.status == Status.UNKNOWN_FEATURES:
        if d[0] < len(features):
            where = f"where the plan has '{features[d[0]].name}'"
        else:
            where = f"after the plan's last, '{features[-1].name}'" if features else "at position 0"
        names = [f.name for f in features]
        expected = str(names) if len(names) <= 8 else f"{str(names[:8])[:-1]}, ...]"
        return (
            f"rank {source} sent a KJT whose features are not the model's (they differ "
            f"{where}; {d[1]} features sent, {d[2]} expected: {expected}): "
            f"every batch must carry the features of the first, in the same order"
        )
    if header.status == Status.BAD_DTYPE:
        what = {
            BadDtype.IDS_NOT_INTEGERS: "ids that are not integers",
            BadDtype.WEIGHTS_NOT_FLOATING: "weights that are not floating point",
            BadDtype.NO_WEIGHTS: "no per-sample weights, for weighted tables",
        }[BadDtype(d[0])]
        return f"rank {source} sent a KJT with {what}"
    return (
        f"rank {source} sent a KJT with a variable batch size per feature, which the PGAS sharding types do not support"
    )
