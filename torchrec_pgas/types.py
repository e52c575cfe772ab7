"""Names and options shared by every part of torchrec_pgas."""

from dataclasses import dataclass
from typing import Literal, Tuple

#: Table-wise sharding whose input and output distributions are one-sided puts.
PGAS_TABLE_WISE: str = "pgas_table_wise"

#: Row-wise sharding whose bucketed ids and partial sums travel by one-sided puts.
PGAS_ROW_WISE: str = "pgas_row_wise"

#: Every sharding type this package adds to TorchRec, in the order they are offered.
PGAS_SHARDING_TYPES: Tuple[str, ...] = (PGAS_TABLE_WISE, PGAS_ROW_WISE)

TransportKind = Literal["auto", "host", "nvshmem"]


@dataclass(frozen=True)
class PgasOptions:
    """Run-time options of the PGAS sharding types.

    Args:
        timeout_s: how long any wait for a peer's data or signal may take before it
            raises ``PgasTimeoutError`` naming the rank, the peer and the step.
        headroom: symmetric buffers are sized at the first batch as ``headroom`` times
            the largest batch (samples and ids) seen on any rank then; a first batch
            with no samples (no ids) on every rank sizes them at 64 samples (1024 ids)
            instead, so an empty warm-up batch does not size them at nothing for good.
            A bigger batch later is refused on every rank, naming this option.

    Every rank must pass equal options: the sharding checks it when it sets up its
    exchange and raises on every rank, naming the fields that differ.
        transport: ``"auto"`` picks NVSHMEM for CUDA devices and the host transport
            for CPU devices.
    """

    timeout_s: float = 120.0
    headroom: float = 2.0
    transport: TransportKind = "auto"
