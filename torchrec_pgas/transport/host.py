"""Host transport: one-sided puts and signals between processes of one machine.

Every symmetric allocation is one shared-memory file per rank in ``/dev/shm``, mapped by
every rank of the process group, so a put is a plain copy into the peer's mapping.

Lifetime: a rank creates its file, all ranks map all files, then each rank unlinks its
own file at once. From then on the memory lives only as long as the mappings, so
nothing is left in ``/dev/shm`` however the processes end, except files of a job killed
in the short window before the unlink; the sweep below removes those.

Naming: ``/dev/shm`` is shared by every local user and by containers that share it but
not their PID namespace. A name anyone can predict lets a local user create it first and
stop every job at its first batch, so each file gets 128 random bits, is created
exclusively (a clash draws a new name) and its name reaches the peers over the process
group. The job token in the name only tells whose files are whose.

Sweep: a creator holds a shared ``flock`` on its file for as long as the file is linked,
and a dead creator's lock goes with it. At start-up each rank removes the files under the
prefix that are its own user's, at least ``SWEEP_MIN_AGE_S`` old (a creator locks its
file just after creating it) and on which it can take the lock exclusively: never
another user's file, never a live one, whatever PID namespace either job runs in, and
nothing that goes wrong with a file it cannot remove stops the job.

Ordering: a signal word is guarded by a process-shared ``pthread_spinlock_t``. The
writer's unlock is a release and the reader's lock an acquire, so every byte put before
a signal is visible to whoever has read that signal, on x86 (TSO) and on Arm alike. The
lock is only ever tried, never waited on: a rank that died holding it would otherwise
leave its peers spinning forever, so every acquisition gives up at the transport's
timeout with ``PgasTimeoutError``.
"""

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import re
import secrets
import stat
import time
import uuid
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from torchrec_pgas.transport.base import (
    PgasError,
    PgasTimeoutError,
    SignalArray,
    SymmetricBuffer,
    Transport,
    raise_unless_every_rank_ready,
)

_SHM_DIR = "/dev/shm"
_PREFIX = "torchrec_pgas"
#: Files the sweep may consider: ours, and those of earlier releases (whose names had
#: a counter, rank and pid in them).
_NAME_RE = re.compile(rf"^{re.escape(_PREFIX)}\.[0-9a-z.]+$")
#: A file younger than this is never swept: its creator may not have locked it yet.
SWEEP_MIN_AGE_S = 10.0
#: Fresh names to draw before giving up on creating a file (a clash of 128 random bits
#: means something else is wrong).
_CREATE_ATTEMPTS = 8
# A signal record: int32 spinlock, int32 padding, int64 value.
_SIGNAL_RECORD = 16
_SIGNAL_VALUE_OFFSET = 8
_PTHREAD_PROCESS_SHARED = 1


def _load_pthread() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("pthread") or ctypes.util.find_library("c"))
    for fn in (lib.pthread_spin_trylock, lib.pthread_spin_unlock):
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    lib.pthread_spin_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.pthread_spin_init.restype = ctypes.c_int
    return lib


_PTHREAD = _load_pthread()


def _create_segment(job: str, size: int) -> Tuple[str, int]:
    """Creates a file of ``size`` bytes under a fresh random name and locks it shared;
    returns its name and the descriptor that holds the lock."""
    for _ in range(_CREATE_ATTEMPTS):
        name = f"{_PREFIX}.{job}.{secrets.token_hex(16)}"
        path = os.path.join(_SHM_DIR, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        return name, fd
    raise PgasError(f"could not create a segment in {_SHM_DIR}: {_CREATE_ATTEMPTS} random names were all taken")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_if_stale(path: str, uid: int, born_before: float) -> bool:
    """Removes ``path`` if it is a regular file of ``uid``, older than ``born_before``,
    and no process holds its lock; any error leaves it where it is."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_mtime > born_before:
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a creator lives
        held = os.fstat(fd)
        if (held.st_dev, held.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep_stale_segments(shm_dir: str = _SHM_DIR, min_age_s: float = SWEEP_MIN_AGE_S) -> List[str]:
    """Removes this user's segments that no live process holds and that are at least
    ``min_age_s`` old; returns their names. Never raises about a file."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    uid = os.geteuid()
    born_before = time.time() - min_age_s
    return [
        name
        for name in names
        if _NAME_RE.match(name) and _remove_if_stale(os.path.join(shm_dir, name), uid, born_before)
    ]


@dataclass
class _Mapping:
    """Every rank's mapping of one allocation, indexed by rank."""

    peers: List[torch.Tensor]
    maps: List[mmap.mmap]


def _as_bytes(src: torch.Tensor) -> torch.Tensor:
    """``src``'s elements in row-major order as one dense run of bytes (uint8 [nbytes]).
    ``contiguous()`` does not give that: a tensor counts as contiguous whatever the
    strides of its dims of size 1 (one id of a strided KJT's values, split per owner),
    and ``view(torch.uint8)`` refuses a last stride other than 1."""
    flat = src.detach().reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


class HostTransport(Transport):
    """Shared-memory transport for the ranks of ``pg``, all on this machine.

    Args:
        pg: a CPU-capable (gloo) process group whose ranks share ``/dev/shm``.
        timeout_s: how long ``wait`` waits, and any signal's lock is tried, before
            they raise.
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
        #: This rank's files not yet unlinked, with the descriptors that hold their locks.
        self._linked: Dict[str, int] = {}
        sweep_stale_segments()

    def _map_all(self, nbytes: int, signals: int = 0) -> _Mapping:
        """Creates this rank's file and maps every rank's (collective). A rank that
        cannot create or map a file says so in the closing collective, so every rank
        raises there, with its maps dropped and its file unlinked, rather than leaving
        its peers waiting for it."""
        size = max(nbytes, 8)
        error = None
        own = None
        try:
            name, fd = _create_segment(self._job, size)
            own = os.path.join(_SHM_DIR, name)
            self._linked[own] = fd
        except (PgasError, OSError) as e:
            name, error = None, f"cannot create a segment of {size} bytes in {_SHM_DIR}: {e}"
        names: List["str | None"] = [None] * self.world_size
        dist.all_gather_object(names, name, group=self.group)
        maps: List[mmap.mmap] = []
        peers: List[torch.Tensor] = []
        if error is None and None not in names:  # a rank without a file says so itself
            error = self._map_peers(names, size, nbytes, maps, peers)  # type: ignore[arg-type]
            if error is None:
                # The lock's unlocked value is the C library's business (it is 1 on x86).
                base = peers[self.rank].data_ptr()
                for i in range(signals):
                    _PTHREAD.pthread_spin_init(base + i * _SIGNAL_RECORD, _PTHREAD_PROCESS_SHARED)
        # Once every rank is past this, every rank has mapped every file and initialized
        # its locks: the files themselves are no longer needed.
        try:
            raise_unless_every_rank_ready(self.group, error)
        except PgasError:
            maps.clear()
            peers.clear()
            raise
        finally:
            if own is not None:
                self._unlink_own(own)
        # Nothing else holds the mapping: it is unmapped when its buffer is dropped.
        return _Mapping(peers=peers, maps=maps)

    def _map_peers(
        self, names: List[str], size: int, nbytes: int, maps: List[mmap.mmap], peers: List[torch.Tensor]
    ) -> "str | None":
        """Maps the files ``names`` into ``maps`` and ``peers``, in rank order; returns
        what went wrong, with nothing left mapped, or None."""
        for peer, peer_name in enumerate(names):
            try:
                if not _NAME_RE.match(peer_name):
                    raise PgasError(f"rank {peer} sent a bad segment name {peer_name!r}")
                peer_fd = os.open(os.path.join(_SHM_DIR, peer_name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    mm = mmap.mmap(peer_fd, size)
                finally:
                    os.close(peer_fd)
            except (PgasError, OSError, ValueError) as e:
                maps.clear()
                peers.clear()
                return f"cannot map the segment of rank {peer}: {e}"
            maps.append(mm)
            peers.append(torch.frombuffer(mm, dtype=torch.uint8)[:nbytes])
        return None

    def _unlink_own(self, path: str) -> None:
        """Unlinks one of this rank's files, then lets go of its lock (in that order: an
        unlocked file that is still linked is fair game for the sweep)."""
        _unlink_quietly(path)
        os.close(self._linked.pop(path))

    def alloc(self, nbytes: int) -> SymmetricBuffer:
        mapping = self._map_all(nbytes)
        return SymmetricBuffer(local=mapping.peers[self.rank], handle=mapping)

    def alloc_signals(self, size: int) -> SignalArray:
        return SignalArray(size=size, handle=self._map_all(size * _SIGNAL_RECORD, signals=size))

    def free(self, obj: "SymmetricBuffer | SignalArray") -> None:
        mapping: _Mapping = obj.handle
        if self.alive():  # a destroyed group has nobody left to wait for
            self.barrier()
        mapping.peers.clear()
        mapping.maps.clear()

    def put(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None:
        data = _as_bytes(src)
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
        data = _as_bytes(src).view(rows, -1)
        dst = buf.handle.peers[peer][offset:].as_strided((rows, data.size(1)), (row_pitch, 1))
        dst.copy_(data)

    def _record(self, sig: SignalArray, rank: int, index: int) -> int:
        if not 0 <= index < sig.size:
            raise IndexError(f"signal index {index} outside [0, {sig.size})")
        return sig.handle.peers[rank].data_ptr() + index * _SIGNAL_RECORD

    def _lock(self, addr: int, deadline: float) -> bool:
        """Takes the spinlock at ``addr``; False if it is still taken at ``deadline``."""
        pause = 0.0
        while _PTHREAD.pthread_spin_trylock(addr) != 0:
            if time.monotonic() > deadline:
                return False
            # A live holder keeps the lock for a few instructions, unless it was
            # descheduled: yield at once, then back off towards 1 ms.
            time.sleep(pause)
            pause = min(pause * 2 or 1e-6, 1e-3)
        return True

    def signal(self, sig: SignalArray, peer: int, index: int, value: int) -> None:
        addr = self._record(sig, peer, index)
        if not self._lock(addr, time.monotonic() + self._timeout_s):
            raise PgasTimeoutError(
                f"rank {self.rank}: timed out after {self._timeout_s:.1f} s waiting for the "
                f"lock of signal {index} of rank {peer}, to set it to {value} (did a rank die "
                f"holding it?)"
            )
        ctypes.c_int64.from_address(addr + _SIGNAL_VALUE_OFFSET).value = value
        _PTHREAD.pthread_spin_unlock(addr)

    def _read(self, addr: int, deadline: float) -> "int | None":
        """The signal word at ``addr``; None if its lock is still taken at ``deadline``."""
        if not self._lock(addr, deadline):
            return None
        value = ctypes.c_int64.from_address(addr + _SIGNAL_VALUE_OFFSET).value
        _PTHREAD.pthread_spin_unlock(addr)
        return value

    def wait(self, sig: SignalArray, index: int, value: int, what: str) -> None:
        addr = self._record(sig, self.rank, index)
        deadline = time.monotonic() + self._timeout_s
        have = self._read(addr, deadline)
        pause = 0.0
        while have is None or have < value:
            if have is None or time.monotonic() > deadline:
                state = (
                    f"the lock of signal {index} stayed taken: did a rank die holding it?"
                    if have is None
                    else f"signal {index} is {have}, expected >= {value}"
                )
                raise PgasTimeoutError(
                    f"rank {self.rank}: timed out after {self._timeout_s:.1f} s waiting for {what} ({state})"
                )
            # Back off towards 1 ms: ranks usually outnumber free cores on CPU machines.
            time.sleep(pause)
            pause = min(pause * 2 or 2e-5, 1e-3)
            have = self._read(addr, deadline)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Removes files of an allocation an error interrupted (mappings go with their
        buffers) and lets go of the process group."""
        for path in list(self._linked):
            self._unlink_own(path)
        self.group = None  # type: ignore[assignment]
