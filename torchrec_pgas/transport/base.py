"""The one-sided transport interface that the host and NVSHMEM transports implement.

A transport gives every rank of a process group *symmetric buffers*: collectively
allocated, the same size on every rank, and writable by any peer without the owner
taking part (a one-sided *put*). *Signals* are 64-bit words in a symmetric signal
array; a put followed by a signal guarantees that the data is visible to the peer
before the signal is, so a reader that waited for the signal may read the data.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class PgasError(RuntimeError):
    """Base class of every error torchrec_pgas raises about distributed state."""


class PgasTimeoutError(PgasError):
    """A wait for a peer's signal did not finish within ``PgasOptions.timeout_s``."""


class PgasTransportUnavailableError(PgasError):
    """The requested transport cannot run here (no NVSHMEM, no peer access, ...)."""


def raise_unless_every_rank_ready(pg: dist.ProcessGroup, error: "str | None") -> None:
    """Raises ``PgasTransportUnavailableError`` on every rank of ``pg`` if any rank
    reports an ``error`` (collective): a rank that cannot set up a transport must not
    leave its peers waiting in the set-up's next collective."""
    errors: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(errors, error, group=pg)
    failed = {rank: e for rank, e in enumerate(errors) if e is not None}
    if failed:
        raise PgasTransportUnavailableError("; ".join(f"rank {rank}: {e}" for rank, e in failed.items()))


@dataclass
class SymmetricBuffer:
    """A symmetric allocation: this rank's part as a flat ``uint8`` tensor.

    ``handle`` is transport specific (peer mappings, NVSHMEM pointers).
    """

    local: torch.Tensor
    handle: Any

    @property
    def nbytes(self) -> int:
        return self.local.numel()


@dataclass
class SignalArray:
    """``size`` symmetric 64-bit signal words per rank, all starting at 0."""

    size: int
    handle: Any


class Transport(ABC):
    """One-sided communication among the ranks of one process group.

    Allocation and ``barrier`` are collective: every rank calls them in the same order
    with the same sizes. Puts, signals and waits are not.
    """

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup

    @abstractmethod
    def alloc(self, nbytes: int) -> SymmetricBuffer:
        """Collectively allocates ``nbytes`` on every rank, zero filled."""

    @abstractmethod
    def alloc_signals(self, size: int) -> SignalArray:
        """Collectively allocates ``size`` signal words on every rank."""

    @abstractmethod
    def free(self, obj: "SymmetricBuffer | SignalArray") -> None:
        """Collectively releases a buffer or signal array."""

    @abstractmethod
    def put(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None:
        """Copies the bytes of contiguous ``src`` into ``peer``'s ``buf`` at byte ``offset``."""

    @abstractmethod
    def put_rows(
        self,
        buf: SymmetricBuffer,
        peer: int,
        offset: int,
        row_pitch: int,
        src: torch.Tensor,
    ) -> None:
        """Copies each row of 2-D ``src`` into ``peer``'s ``buf``: row ``i`` starts at
        byte ``offset + i * row_pitch``. This is how a pooled row lands at its column
        block of the requester's output without any later permute."""

    @abstractmethod
    def signal(self, sig: SignalArray, peer: int, index: int, value: int) -> None:
        """Sets word ``index`` of ``peer``'s signal array to ``value``, after every put
        this rank issued before it has become visible to ``peer``."""

    @abstractmethod
    def wait(self, sig: SignalArray, index: int, value: int, what: str) -> None:
        """Waits until this rank's signal word ``index`` is at least ``value``; data
        put before that signal is then visible. Raises ``PgasTimeoutError`` whose
        message includes ``what`` after the timeout. A device transport enqueues the
        wait on the current stream instead (and reports a timeout at its next check)."""

    def alive(self) -> bool:
        """Whether the transport's process group still exists. Destroying a group
        leaves one-sided buffers mapped and writable, so nothing else would stop a
        model from serving over a group its job has torn down."""
        if self.group is None:
            return False
        try:
            dist.get_rank(self.group)
        except (RuntimeError, ValueError):  # not initialized, or group not registered
            return False
        return True

    def check_alive(self, what: str) -> None:
        """Raises ``PgasError`` naming ``what`` (e.g. a mailbox of a sharding) unless the
        process group still exists; cheap enough for every step (a lookup in the
        process group registry, no communication)."""
        if not self.alive():
            raise PgasError(
                f"rank {self.rank}: the process group of {what} was destroyed "
                f"(torch.distributed.destroy_process_group): a model sharded over it "
                f"cannot run another step; shard it again over a live process group"
            )

    @abstractmethod
    def barrier(self) -> None:
        """Collective barrier over the transport's ranks."""

    @abstractmethod
    def close(self) -> None:
        """Releases everything this transport allocated; safe to call twice."""
