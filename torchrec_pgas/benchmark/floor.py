"""The hardware floor of an embedding forward, in two parts.

Per configuration, with the tables placed as ``config.table_specs`` says (table-wise
on an owner, or row-wise over every rank), the busiest rank must

* read from memory every row its lookups touch, plus the ids, and write its pooled
  rows: ``memory_bytes``, at the device's memory bandwidth (``copy_gbps``: a large
  device-to-device copy, bytes read plus written) gives ``memory_ms``;
* send the ids that other ranks' rows answer, and the pooled rows (whole for a
  table-wise table, partial sums for a row-wise one) that other ranks asked for:
  ``link_bytes``, at the link bandwidth (``link_gbps``) gives ``link_ms``.

Each rank's bytes are the sum of its tables' (``table_traffic``), so mixed placements
add up; the busiest rank is the one with the most of either part. Row-wise tables
assume ids spread evenly over the row ranges (uniform ids, or Zipf's hot rows
scattered by a permutation, as ``workload`` draws them).

The link bandwidth is what the sharding's own puts can reach: on GPUs, a put+signal
of tens of MiB issued from the device by many blocks at once (``put_signal``'s kernel,
the path the lookup's pooled rows take), not one host-issued put, which reaches well
under half of it; on CPUs, a put through the host transport (a shared-memory copy).
``MEMORY_BANDWIDTH`` and ``LINK_BANDWIDTH`` say so in the report.

The two parts are reported separately (``Floor.fields``: each part's bytes, bandwidth
and time), and the floor combines them as their maximum:
the one-sided design overlaps them (the lookup kernel stores each pooled row straight
into the requester's output while it reads the next rows), so in the best case the
forward takes as long as the slower of the two. A design that ran them one after the
other (an all-to-all, then the lookup, then another all-to-all) would have their sum
as its floor instead.

The bandwidths alone, at several sizes, on every process of a launch:

    torchrun --standalone --nproc_per_node=2 -m torchrec_pgas.benchmark.floor
"""

import time
from dataclasses import dataclass
from typing import Callable, Dict

import torch
import torch.distributed as dist

from torchrec_pgas.benchmark.config import Config, TableSpec, table_specs
from torchrec_pgas.transport import get_transport
from torchrec_pgas.types import PgasOptions

_ID_BYTES = 8
_ELEM_BYTES = 4  # fp32 tables and outputs
#: Rows of ``put_signal``'s grid in the link measurement, each putting its own share
#: of the buffer with ``PROGRAMS_PER_PEER`` blocks: 32 x 32 = 1024 blocks in flight,
#: enough to saturate NVLink (fewer leave it partly idle).
_LINK_ROWS = 32
_LINK_REPS = 10
#: Enough rounds of 64 MiB (about 4 ms at NVLink 4 speed) that the ranks' skew at the
#: start, tens of microseconds, stays within a few percent.
_DEVICE_LINK_REPS = 20


@dataclass(frozen=True)
class Traffic:
    memory_bytes: int
    link_bytes: int


#: The bandwidth each part of the floor is taken at, as the report states it.
MEMORY_BANDWIDTH = "copy bandwidth: a large device-to-device copy, bytes read plus written"
LINK_BANDWIDTH = (
    f"device-initiated put bandwidth: puts+signals to the next rank issued from the device by "
    f"{_LINK_ROWS} rows of put_signal's blocks at once (the kernel that puts the pooled rows); "
    f"on CPUs the host transport's put"
)


@dataclass(frozen=True)
class Floor:
    """The floor of one forward: each part its bytes over its own bandwidth (GB/s),
    and their combination (see module doc)."""

    memory_bytes: int
    link_bytes: int
    copy_gbps: float
    link_gbps: float

    @property
    def memory_ms(self) -> float:
        return self.memory_bytes / self.copy_gbps / 1e6

    @property
    def link_ms(self) -> float:
        """0 where nothing crosses a link (one rank), whatever the link's bandwidth."""
        return self.link_bytes / self.link_gbps / 1e6 if self.link_bytes else 0.0

    @property
    def floor_ms(self) -> float:
        return max(self.memory_ms, self.link_ms)

    def fields(self) -> Dict[str, float]:
        """The floor, its parts and what they were taken at, for a result row."""
        return {
            "floor_ms": self.floor_ms,
            "memory_ms": self.memory_ms,
            "memory_bytes": self.memory_bytes,
            "copy_gbps": self.copy_gbps,
            "link_ms": self.link_ms,
            "link_bytes": self.link_bytes,
            "link_gbps": self.link_gbps,
        }


def table_traffic(spec: TableSpec, cfg: Config, rank: int) -> Traffic:
    """One table's share of ``rank``'s traffic in one forward.

    Table-wise, its owner looks up every rank's ids and writes every rank's pooled
    rows, and sends the other ranks theirs; another rank sends it its ids. Row-wise,
    every rank looks up the ``1 / ranks`` of all ids that fall in its rows, writes a
    partial sum for every sample of every rank, sends the others theirs, and sends out
    the ``(ranks - 1) / ranks`` of its own ids that other ranks' rows answer."""
    row, ids = cfg.dim * _ELEM_BYTES, cfg.batch_size * spec.ids_per_bag
    peers = cfg.ranks - 1
    if spec.row_wise:
        memory = ids * (row + _ID_BYTES) + cfg.ranks * cfg.batch_size * row
        return Traffic(memory, ids * peers // cfg.ranks * _ID_BYTES + peers * cfg.batch_size * row)
    if spec.rank != rank:
        return Traffic(0, ids * _ID_BYTES)
    memory = cfg.ranks * ids * (row + _ID_BYTES) + cfg.ranks * cfg.batch_size * row
    return Traffic(memory, peers * cfg.batch_size * row)


def traffic(cfg: Config) -> Traffic:
    """The busiest rank's memory and link traffic of one forward (see module doc):
    each part the most of any rank's (no link at all on a single rank)."""
    specs = table_specs(cfg)
    per_rank = [[table_traffic(s, cfg, r) for s in specs] for r in range(cfg.ranks)]
    memory = max(sum(t.memory_bytes for t in ts) for ts in per_rank)
    link = max(sum(t.link_bytes for t in ts) for ts in per_rank) if cfg.ranks > 1 else 0
    return Traffic(memory_bytes=memory, link_bytes=link)


def floor(cfg: Config, copy_gbps: float, link_gbps: float) -> Floor:
    """The least time the forward of ``cfg`` can take at these bandwidths (GB/s), by
    part: memory at ``copy_gbps`` (``copy_gbps``), link at ``link_gbps`` (``link_gbps``:
    device-initiated multi-block puts on GPUs)."""
    t = traffic(cfg)
    if copy_gbps <= 0:
        raise ValueError(f"the floor's memory part needs a positive copy bandwidth, got {copy_gbps} GB/s")
    if t.link_bytes and link_gbps <= 0:
        raise ValueError(
            f"the floor's link part ({t.link_bytes} bytes on {cfg.ranks} ranks) needs a positive link "
            f"bandwidth, got {link_gbps} GB/s"
        )
    return Floor(t.memory_bytes, t.link_bytes, copy_gbps, link_gbps)


def _time_ms(fn: Callable[[], None], device: torch.device, reps: int = _LINK_REPS) -> float:
    """Milliseconds per call of ``fn`` (after one untimed call), the device drained."""
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


def link_gbps(pg: dist.ProcessGroup, device: torch.device, nbytes: int = 1 << 26) -> float:
    """Bandwidth (GB/s per direction) of every rank putting ``nbytes`` into the next
    rank's symmetric buffer while the previous rank puts into its own: device-initiated
    multi-block put+signal on GPUs, the host transport's put on CPUs (collective; the
    slowest rank's; 0 on a single rank)."""
    world = dist.get_world_size(pg)
    if world == 1:
        return 0.0
    transport = get_transport(pg, device, PgasOptions())
    gbps = _device_put_gbps(transport, nbytes) if device.type == "cuda" else _host_put_gbps(transport, nbytes, device)
    rate = torch.tensor([gbps], device=device)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN, group=pg)
    return float(rate)


def _host_put_gbps(transport, nbytes: int, device: torch.device) -> float:
    buffer = transport.alloc(nbytes)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    peer = (transport.rank + 1) % transport.world_size
    transport.barrier()
    ms = _time_ms(lambda: transport.put(buffer, peer, 0, src), device)
    transport.barrier()
    transport.free(buffer)
    return nbytes / ms / 1e6


def link_chunks(nbytes: int, src_address: int, blocks_per_row: int) -> torch.Tensor:
    """``put_signal``'s chunks (int64 [rows, 1, 3]: destination offset, source address,
    bytes) for ``_LINK_ROWS`` rows that together put the first ``nbytes`` of
    ``src_address`` at the same offsets of the destination, one slice each; rounded
    down so that every block of a row gets the same whole number of 16-byte words."""
    unit = _LINK_ROWS * blocks_per_row * 16
    share = nbytes // unit * unit // _LINK_ROWS
    if share == 0:
        raise ValueError(f"the link measurement needs at least {unit} bytes, got {nbytes}")
    offsets = torch.arange(_LINK_ROWS, dtype=torch.int64) * share
    return torch.stack([offsets, offsets + src_address, torch.full_like(offsets, share)], dim=1).view(-1, 1, 3)


def _device_put_gbps(transport, nbytes: int) -> float:
    """GB/s of puts+signals of ``nbytes`` (rounded down, see ``link_chunks``) to the next
    rank, each timed from its launch to the arrival of the previous rank's put here (a
    stream-ordered wait on its signal).

    One launch of ``put_signal`` with ``_LINK_ROWS`` rows, all to the same peer, each
    putting its own slice: the grid the sharding's exchange runs with many peers."""
    from torchrec_pgas.kernels.put_signal import PROGRAMS_PER_PEER, arrived, put_signal
    from torchrec_pgas.kernels.signal_wait import signal_wait
    from torchrec_pgas.kernels.signals import WAIT_DATA
    from torchrec_pgas.kernels.step_clock import fixed

    device, me, world = transport.device, transport.rank, transport.world_size
    src = torch.ones(int(link_chunks(nbytes, 0, PROGRAMS_PER_PEER)[:, 0, 2].sum()), dtype=torch.uint8, device=device)
    chunks = link_chunks(src.numel(), src.data_ptr(), PROGRAMS_PER_PEER).to(device)
    dst = transport.symmetric_tensor((src.numel(),), torch.uint8)
    ready = transport.symmetric_tensor((world,), torch.int64)
    peers = torch.full((_LINK_ROWS,), (me + 1) % world, dtype=torch.int32, device=device)
    sender = torch.tensor([(me - 1) % world], dtype=torch.int32, device=device)
    no_wait = torch.zeros(world, dtype=torch.int64, device=device)
    step = 0

    def put_and_wait() -> None:
        nonlocal step
        step += 1
        dev = transport.device
        put_signal(peers, chunks, dst, ready, no_wait, transport.err, me, fixed(step, dev), 0, transport.timeout_ns)
        signal_wait(
            ready, sender, fixed(_LINK_ROWS * arrived(step), dev), transport.err, WAIT_DATA.value, transport.timeout_ns
        )

    # A first round compiles the kernels, each rank in its own time: the ranks start
    # the timed rounds together, else the first would wait for a peer's compiler.
    put_and_wait()
    torch.cuda.synchronize(device)
    transport.barrier()
    ms = _time_ms(put_and_wait, device, reps=_DEVICE_LINK_REPS)
    transport.check("the floor's link measurement")
    transport.free_tensors([dst, ready])
    return src.numel() / ms / 1e6


def main() -> None:
    """Prints the copy and link bandwidths at 16, 64 and 256 MiB (rank 0)."""
    from torchrec_pgas.process import finish, start_rank

    device = start_rank()
    group = dist.group.WORLD
    put = "device-initiated put" if device.type == "cuda" else "host transport put"
    for shift in (24, 26, 28):
        copy, link = copy_gbps(device, 1 << shift), link_gbps(group, device, 1 << shift)
        puts = f"{put} {link:7.1f} GB/s per direction" if dist.get_world_size() > 1 else "no link (one rank)"
        if dist.get_rank() == 0:
            print(f"{1 << (shift - 20):>4} MiB: copy {copy:8.1f} GB/s, {puts}", flush=True)
    finish()


if __name__ == "__main__":
    main()
