"""Names and options shared by every part of torchrec_pgas."""

import math
import numbers
from dataclasses import dataclass
from typing import Literal, Optional, Tuple, get_args

#: Table-wise sharding whose input and output distributions are one-sided puts.
PGAS_TABLE_WISE: str = "pgas_table_wise"

#: Row-wise sharding whose bucketed ids and partial sums travel by one-sided puts.
PGAS_ROW_WISE: str = "pgas_row_wise"

#: Every sharding type this package adds to TorchRec, in the order they are offered.
PGAS_SHARDING_TYPES: Tuple[str, ...] = (PGAS_TABLE_WISE, PGAS_ROW_WISE)

TransportKind = Literal["auto", "host", "nvshmem"]

#: How the GPU path writes into a peer's memory (``PgasOptions.remote_path``).
RemotePath = Literal["auto", "put"]
SparseUpdate = Literal["fused", "fbgemm"]


@dataclass(frozen=True)
class PgasOptions:
    """Run-time options of the PGAS sharding types.

    Args:
        timeout_s: how long any wait for a peer's data or signal may take before it
            raises ``PgasTimeoutError`` naming the rank, the peer and the step.
        headroom: symmetric buffers are sized at the first batch as ``headroom`` times
            the largest batch (samples and ids) seen on any rank then, and at least
            128 samples and 8192 ids per source, so that a small or empty warm-up
            batch does not size them at nothing for good. A bigger batch later is
            refused on every rank, naming this option.
        max_batch_size: the most samples a rank's batch will have, where a later batch
            may outgrow the first one times ``headroom`` (an evaluation batch larger
            than the training batch): the buffers then take batches of this size, with
            ``headroom`` times the first batch's ids per sample (the largest of any
            rank's; an empty first batch gives none, and the ids the least capacity).
            None: the first batch sets the size alone.
        transport: ``"auto"`` picks NVSHMEM for CUDA devices and the host transport
            for CPU devices.
        remote_path: how the NVSHMEM transport writes rows, gradients and signals into
            a peer. ``"auto"``: plain stores through the peer mapping where NVSHMEM
            gives one (``nvshmem_ptr``: GPUs of one node), NVSHMEM puts elsewhere
            (other nodes). ``"put"``: NVSHMEM puts for every peer but this rank, which
            runs the code of the multi-node path on one node (to test it), and is the
            path that works for several ranks sharing one GPU, where peer mappings are
            not reliable.
        sparse_update: how a GPU training step updates fused tables. ``"fused"``:
            for ``EXACT_SGD`` and ``EXACT_ROWWISE_ADAGRAD`` over fp32 tables in device
            memory, the backward applies the optimizer with this project's kernels
            over an index tensor of fixed capacity: the step reads nothing back to the
            host and can be captured in a CUDA graph (weights equal FBGEMM's to fp32
            rounding); other tables take FBGEMM's backward. ``"fbgemm"``: FBGEMM's
            fused backward always, as under TorchRec's sharding types, at the cost of
            one read-back per step (the batch's id count: FBGEMM sorts its whole index
            tensor), which then holds the batch's ids only, where the fused update
            sorts the index tensor's whole capacity (``headroom`` times the first
            batch's ids; examples/benchmark_results/README.md compares them).

    Every rank must pass equal options: the sharding checks it when it sets up its
    exchange and raises on every rank, naming the fields that differ.
    """

    timeout_s: float = 120.0
    headroom: float = 2.0
    max_batch_size: Optional[int] = None
    transport: TransportKind = "auto"
    remote_path: RemotePath = "auto"
    sparse_update: SparseUpdate = "fused"

    def __post_init__(self) -> None:
        choices = (("transport", TransportKind), ("remote_path", RemotePath), ("sparse_update", SparseUpdate))
        for field, allowed in choices:
            value = getattr(self, field)
            if value not in get_args(allowed):
                raise ValueError(f"PgasOptions.{field} must be one of {list(get_args(allowed))}, got {value!r}")
        if not _number(self.timeout_s) or not 0 < self.timeout_s < math.inf:
            raise ValueError(f"PgasOptions.timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if not _number(self.headroom) or not 1 <= self.headroom <= MAX_HEADROOM:
            raise ValueError(f"PgasOptions.headroom must be a number from 1 to {MAX_HEADROOM}, got {self.headroom!r}")
        size = self.max_batch_size
        if size is not None and (not _number(size, integral=True) or not 1 <= size <= MAX_BATCH_SIZE):
            raise ValueError(
                f"PgasOptions.max_batch_size must be None or an int from 1 to {MAX_BATCH_SIZE}, got {size!r}"
            )


#: Bounds of ``PgasOptions.headroom`` and ``max_batch_size``: past them the slots' sizes
#: would not be allocated, or would overflow the int32 lengths and offsets of a slot.
MAX_HEADROOM = 1024.0
MAX_BATCH_SIZE = 2**31 - 1


def _number(value: object, integral: bool = False) -> bool:
    """A real number (numpy's too), not a bool; with ``integral``, a whole one."""
    kind = numbers.Integral if integral else numbers.Real
    return isinstance(value, kind) and not isinstance(value, bool)
