"""One-sided transports: the interface, the host (shared memory) implementation, and
the mailbox protocol that the sharding types build on."""

import atexit
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from torchrec_pgas.transport.base import (
    PgasError,
    PgasTimeoutError,
    PgasTransportUnavailableError,
    SignalArray,
    SymmetricBuffer,
    Transport,
)
from torchrec_pgas.transport.mailbox import Mailbox
from torchrec_pgas.types import PgasOptions

__all__ = [
    "Mailbox",
    "PgasError",
    "PgasTimeoutError",
    "PgasTransportUnavailableError",
    "SignalArray",
    "SymmetricBuffer",
    "Transport",
    "get_transport",
]

_TRANSPORTS: Dict[Tuple[int, str, float, str], Tuple[dist.ProcessGroup, Transport]] = {}


@atexit.register
def _close_all() -> None:
    """Closes every transport while the interpreter is still whole. The cache holds
    process groups: were they left to interpreter finalization, gloo would tear its
    worker threads down then and abort the process."""
    for _, transport in _TRANSPORTS.values():
        transport.close()
    _TRANSPORTS.clear()


def _resolve_kind(device: torch.device, options: PgasOptions) -> str:
    if options.transport != "auto":
        return options.transport
    return "nvshmem" if device.type == "cuda" else "host"


def _refuse_a_subgroup_for_nvshmem(pg: dist.ProcessGroup) -> None:
    """NVSHMEM starts once per process, over every process of the job, and its
    symmetric allocations are collective over all of them: a transport over a group
    of some of the processes would wait for the others forever."""
    world, size = dist.get_world_size(), dist.get_world_size(pg)
    if size != world:
        raise PgasTransportUnavailableError(
            f"rank {dist.get_rank()}: the NVSHMEM transport spans every process of the job "
            f"({world}), not a group of {size}: shard PGAS tables over all ranks, or launch "
            f"{size} processes"
        )


def get_transport(pg: dist.ProcessGroup, device: torch.device, options: PgasOptions) -> Transport:
    """The transport for ``pg`` (created collectively on first use, then shared).

    ``options.transport="auto"`` chooses NVSHMEM for CUDA devices and the host
    transport otherwise.
    """
    kind = _resolve_kind(device, options)
    key = (id(pg), kind, options.timeout_s, options.remote_path)
    if key not in _TRANSPORTS:
        if kind == "host":
            from torchrec_pgas.transport.host import HostTransport

            transport: Transport = HostTransport(pg, timeout_s=options.timeout_s)
        elif kind == "nvshmem":
            from torchrec_pgas.transport.nvshmem import NvshmemTransport

            _refuse_a_subgroup_for_nvshmem(pg)

            transport = NvshmemTransport(pg, device, timeout_s=options.timeout_s, remote_path=options.remote_path)
        else:
            raise ValueError(f"unknown transport {kind!r}: expected 'auto', 'host' or 'nvshmem'")
        _TRANSPORTS[key] = (pg, transport)
    return _TRANSPORTS[key][1]
