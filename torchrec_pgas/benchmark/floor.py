"""The hardware floor of a table-wise embedding forward.

Per configuration, the busiest rank (the owner of the most tables) must

* read from memory every row its lookups touch, plus the ids, and write its pooled
  rows: ``memory_bytes``;
* send the ids of the tables it does not own, and the pooled rows of its tables that
  other ranks asked for: ``link_bytes`` (NVLink between GPUs, shared memory on CPUs).

Both are measured against bandwidths taken in the same run: a device-to-device copy
(``copy_gbps``, bytes read plus written) and a put of a large buffer into a peer
through the PGAS transport (``put_gbps``). Memory traffic and link traffic overlap in
the best case, so the floor is the larger of the two times.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchrec_pgas.benchmark.config import Config
from torchrec_pgas.transport import get_transport
from torchrec_pgas.types import PgasOptions

_ID_BYTES = 8
_ELEM_BYTES = 4  # fp32 tables and outputs


@dataclass(frozen=True)
class Traffic:
    memory_bytes: int
    link_bytes: int


def traffic(cfg: Config) -> Traffic:
    """The busiest rank's memory and link traffic of one forward (see module doc)."""
    owned = math.ceil(cfg.tables / cfg.ranks)
    lookups = owned * cfg.ranks * cfg.batch_size * cfg.ids_per_bag
    pooled = owned * cfg.ranks * cfg.batch_size * cfg.dim * _ELEM_BYTES
    memory = lookups * (cfg.dim * _ELEM_BYTES + _ID_BYTES) + pooled
    remote_ids = (cfg.tables - owned) * cfg.batch_size * cfg.ids_per_bag * _ID_BYTES
    remote_rows = owned * (cfg.ranks - 1) * cfg.batch_size * cfg.dim * _ELEM_BYTES
    return Traffic(memory_bytes=memory, link_bytes=remote_ids + remote_rows if cfg.ranks > 1 else 0)


def _time_ms(fn, device: torch.device, reps: int = 10) -> float:
    import time

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - begin) * 1e3 / reps


def copy_gbps(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Device memory bandwidth of a large copy (bytes read plus written per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def put_gbps(pg: dist.ProcessGroup, device: torch.device, nbytes: int = 1 << 28) -> float:
    """Bandwidth of one-sided puts of ``nbytes`` into the next rank's symmetric buffer
    through the PGAS transport (collective; 0 on a single rank)."""
    world = dist.get_world_size(pg)
    if world == 1:
        return 0.0
    transport = get_transport(pg, device, PgasOptions())
    buffer = transport.alloc(nbytes)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    peer = (dist.get_rank(pg) + 1) % world
    transport.barrier()
    ms = _time_ms(lambda: transport.put(buffer, peer, 0, src), device)
    transport.barrier()
    transport.free(buffer)
    rate = torch.tensor([nbytes / ms / 1e6], device=device)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN, group=pg)
    return float(rate)


def floor_ms(cfg: Config, copy: float, put: float) -> float:
    """The least time the forward of ``cfg`` can take at these bandwidths (GB/s)."""
    t = traffic(cfg)
    memory_ms = t.memory_bytes / copy / 1e6
    link_ms = t.link_bytes / put / 1e6 if t.link_bytes else 0.0
    return max(memory_ms, link_ms)
