"""Host transport: one-sided puts and signals between processes of one machine.

Every symmetric allocation is one shared-memory file per rank in ``/dev/shm``, mapped by
every rank of the process group, so a put is a plain copy into the peer's mapping.

Lifetime: a rank creates its file, all ranks map all files, then each rank unlinks its
own file at once. From then on the memory lives only as long as the mappings, so
nothing is left in ``/dev/shm`` however the processes end. Files of a job killed in the
short window before the unlink carry the creator's pid and are swept at the next start.

Ordering: a signal word is guarded by a process-shared ``pthread_spinlock_t``. The
writer's unlock is a release and the reader's lock an acquire, so every byte put before
a signal is visible to whoever has read that signal, on x86 (TSO) and on Arm alike.
"""

import ctypes
import ctypes.util
import mmap
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import List, Set

import torch
import torch.distributed as dist

from torchrec_pgas.transport.base import (
    PgasTimeoutError,
    SignalArray,
    SymmetricBuffer,
    Transport,
)

_SHM_DIR = "/dev/shm"
_PREFIX = "torchrec_pgas"
_NAME_RE = re.compile(rf"^{_PREFIX}\.[0-9a-f]+\.\d+\.r\d+\.p(\d+)$")
# A signal record: int32 spinlock, int32 padding, int64 value.
_SIGNAL_RECORD = 16
_SIGNAL_VALUE_OFFSET = 8
_PTHREAD_PROCESS_SHARED = 1


def _load_pthread() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("pthread") or ctypes.util.find_library("c"))
    for fn in (lib.pthread_spin_lock, lib.pthread_spin_unlock):
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    lib.pthread_spin_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.pthread_spin_init.restype = ctypes.c_int
    return lib


_PTHREAD = _load_pthread()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(shm_dir: str = _SHM_DIR) -> List[str]:
    """Removes segments whose creating process is gone; returns their names."""
    removed = []
    for name in os.listdir(shm_dir) if os.path.isdir(shm_dir) else []:
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


@dataclass
class _Mapping:
    """Every rank's mapping of one allocation, indexed by rank."""

    peers: List[torch.Tensor]
    maps: List[mmap.mmap]


class HostTransport(Transport):
    """Shared-memory transport for the ranks of ``pg``, all on this machine.

    Args:
        pg: a CPU-capable (gloo) process group whose ranks share ``/dev/shm``.
        timeout_s: how long ``wait`` waits before it raises.
    """

    def __init__(self, pg: dist.ProcessGroup, timeout_s: float) -> None:
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.device = torch.device("cpu")
        self.group = pg
        self._timeout_s = timeout_s
        job = [uuid.uuid4().hex[:16] if self.rank == 0 else None]
        dist.broadcast_object_list(job, src=dist.get_global_rank(pg, 0), group=pg)
        self._job: str = job[0]  # type: ignore[assignment]
        self._count = 0
        self._unlinked_pending: Set[str] = set()
        sweep_stale_segments()

    def _path(self, n: int, rank: int, pid: int) -> str:
        return os.path.join(_SHM_DIR, f"{_PREFIX}.{self._job}.{n}.r{rank}.p{pid}")

    def _map_all(self, nbytes: int, signals: int = 0) -> _Mapping:
        n = self._count
        self._count += 1
        size = max(nbytes, 8)
        own = self._path(n, self.rank, os.getpid())
        fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._unlinked_pending.add(own)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        pids = [None] * self.world_size
        dist.all_gather_object(pids, os.getpid(), group=self.group)
        maps, peers = [], []
        for peer, pid in enumerate(pids):
            fd = os.open(self._path(n, peer, pid), os.O_RDWR)
            try:
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            maps.append(mm)
            peers.append(torch.frombuffer(mm, dtype=torch.uint8)[:nbytes])
        # The lock's unlocked value is the C library's business (it is 1 on x86).
        base = peers[self.rank].data_ptr()
        for i in range(signals):
            _PTHREAD.pthread_spin_init(base + i * _SIGNAL_RECORD, _PTHREAD_PROCESS_SHARED)
        # Every rank has mapped every file and initialized its locks: the files
        # themselves are no longer needed.
        self.barrier()
        try:
            os.unlink(own)
        except FileNotFoundError:  # swept by a rank that cannot see this pid
            pass
        self._unlinked_pending.discard(own)
        # Nothing else holds the mapping: it is unmapped when its buffer is dropped.
        return _Mapping(peers=peers, maps=maps)

    def alloc(self, nbytes: int) -> SymmetricBuffer:
        mapping = self._map_all(nbytes)
        return SymmetricBuffer(local=mapping.peers[self.rank], handle=mapping)

    def alloc_signals(self, size: int) -> SignalArray:
        return SignalArray(size=size, handle=self._map_all(size * _SIGNAL_RECORD, signals=size))

    def free(self, obj: "SymmetricBuffer | SignalArray") -> None:
        mapping: _Mapping = obj.handle
        self.barrier()
        mapping.peers.clear()
        mapping.maps.clear()

    def put(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None:
        data = src.detach().contiguous().view(-1).view(torch.uint8)
        buf.handle.peers[peer][offset : offset + data.numel()].copy_(data)

    def put_rows(
        self,
        buf: SymmetricBuffer,
        peer: int,
        offset: int,
        row_pitch: int,
        src: torch.Tensor,
    ) -> None:
        rows = src.size(0)
        if rows == 0 or src.numel() == 0:
            return
        data = src.detach().contiguous().view(torch.uint8).view(rows, -1)
        dst = buf.handle.peers[peer][offset:].as_strided(
            (rows, data.size(1)), (row_pitch, 1)
        )
        dst.copy_(data)

    def _record(self, sig: SignalArray, rank: int, index: int) -> int:
        if not 0 <= index < sig.size:
            raise IndexError(f"signal index {index} outside [0, {sig.size})")
        return sig.handle.peers[rank].data_ptr() + index * _SIGNAL_RECORD

    def signal(self, sig: SignalArray, peer: int, index: int, value: int) -> None:
        addr = self._record(sig, peer, index)
        _PTHREAD.pthread_spin_lock(addr)
        ctypes.c_int64.from_address(addr + _SIGNAL_VALUE_OFFSET).value = value
        _PTHREAD.pthread_spin_unlock(addr)

    def _read(self, addr: int) -> int:
        _PTHREAD.pthread_spin_lock(addr)
        value = ctypes.c_int64.from_address(addr + _SIGNAL_VALUE_OFFSET).value
        _PTHREAD.pthread_spin_unlock(addr)
        return value

    def wait(self, sig: SignalArray, index: int, value: int, what: str) -> None:
        addr = self._record(sig, self.rank, index)
        have = self._read(addr)
        if have >= value:
            return
        deadline = time.monotonic() + self._timeout_s
        pause = 0.0
        while True:
            # Back off towards 1 ms: ranks usually outnumber free cores on CPU machines.
            time.sleep(pause)
            pause = min(pause * 2 or 2e-5, 1e-3)
            have = self._read(addr)
            if have >= value:
                return
            if time.monotonic() > deadline:
                raise PgasTimeoutError(
                    f"rank {self.rank}: timed out after {self._timeout_s:.1f} s waiting "
                    f"for {what} (signal {index} is {have}, expected >= {value})"
                )

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Removes files of an allocation an error interrupted (mappings go with their
        buffers) and lets go of the process group."""
        for path in list(self._unlinked_pending):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._unlinked_pending.clear()
        self.group = None  # type: ignore[assignment]
