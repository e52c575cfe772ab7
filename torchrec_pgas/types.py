"""Names and options shared by every part of torchrec_pgas."""

from dataclasses import dataclass
from typing import Literal, Tuple, get_args

#: Table-wise sharding whose input and output distributions are one-sided puts.
PGAS_TABLE_WISE: str = "pgas_table_wise"

#: Row-wise sharding whose bucketed ids and partial sums travel by one-sided puts.
PGAS_ROW_WISE: str = "pgas_row_wise"

#: Every sharding type this package adds to TorchRec, in the order they are offered.
PGAS_SHARDING_TYPES: Tuple[str, ...] = (PGAS_TABLE_WISE, PGAS_ROW_WISE)

TransportKind = Literal["auto", "host", "nvshmem"]

#: How the GPU path writes into a peer's memory (``PgasOptions.remote_path``).
RemotePath = Literal["auto", "put"]


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
        transport: ``"auto"`` picks NVSHMEM for CUDA devices and the host transport
            for CPU devices.
        remote_path: how the NVSHMEM transport writes rows, gradients and signals into
            a peer. ``"auto"``: plain stores through the peer mapping where NVSHMEM
            gives one (``nvshmem_ptr``: GPUs of one node), NVSHMEM puts elsewhere
            (other nodes). ``"put"``: NVSHMEM puts for every peer but this rank, which
            runs the code of the multi-node path on one node (to test it), and is the
            path that works for several ranks sharing one GPU, where peer mappings are
            not reliable.

    Every rank must pass equal options: the sharding checks it when it sets up its
    exchange and raises on every rank, naming the fields that differ.
    """

    timeout_s: float = 120.0
    headroom: float = 2.0
    transport: TransportKind = "auto"
    remote_path: RemotePath = "auto"

    def __post_init__(self) -> None:
        if self.remote_path not in get_args(RemotePath):
            raise ValueError(
                f"PgasOptions.remote_path must be one of {list(get_args(RemotePath))}, got {self.remote_path!r}"
            )
