"""The host transport among other local users, dead peers and a destroyed process group:
foreign and predicted files in /dev/shm, a rank that dies holding a signal's lock, and a
model asked to serve after ``destroy_process_group``. Real processes throughout."""

import ctypes
import ctypes.util
import os
import re
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist
from dist_utils import (
    assert_close_to_reference,
    make_tables,
    pgas_tw,
    random_kjt,
    reference_pooled,
    run_ranks,
    shard,
    stream_through_mailbox,
)
from torchrec import EmbeddingBagCollection

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding_plan import pgas_row_wise
from torchrec_pgas.transport import Mailbox, PgasError, PgasTimeoutError
from torchrec_pgas.transport.host import HostTransport, sweep_stale_segments

SHM = "/dev/shm"
#: Another user's uid ("nobody").
OTHER_UID = 65534
#: Older than the sweep's minimum age.
LONG_AGO = time.time() - 3600


def _dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()
    return dead.pid


def _legacy_name(pid: int, counter: int = 0, rank: int = 0, job: str = "") -> str:
    """A segment name as the transport once made them: job token, counter, rank, pid."""
    return f"torchrec_pgas.{job or uuid.uuid4().hex[:16]}.{counter}.r{rank}.p{pid}"


def _make_file(path, uid=None, mtime=LONG_AGO) -> None:
    with open(path, "wb") as f:
        f.write(b"x")
    if uid is not None:
        os.chown(path, uid, -1)
    os.utime(path, (mtime, mtime))


# ------------------------------------------------------------------ the sweep


def test_sweep_removes_only_our_old_unlocked_files(tmp_path):
    stale = tmp_path / f"torchrec_pgas.{uuid.uuid4().hex[:16]}.{uuid.uuid4().hex}"
    young = tmp_path / f"torchrec_pgas.{uuid.uuid4().hex[:16]}.{uuid.uuid4().hex}"
    unrelated = tmp_path / "unrelated"
    _make_file(stale)
    _make_file(young, mtime=time.time())  # its creator may be about to lock it
    _make_file(unrelated)
    assert sweep_stale_segments(str(tmp_path)) == [stale.name]
    assert not stale.exists() and young.exists() and unrelated.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user takes root")
def test_sweep_leaves_files_of_other_users_alone(tmp_path):
    foreign = tmp_path / _legacy_name(_dead_pid())
    _make_file(foreign, uid=OTHER_UID)
    assert sweep_stale_segments(str(tmp_path)) == []
    assert foreign.exists()


def test_sweep_tolerates_files_it_may_not_remove(tmp_path, monkeypatch):
    protected = tmp_path / _legacy_name(_dead_pid())
    _make_file(protected)
    unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if os.fspath(path) == str(protected):
            raise PermissionError(13, "Permission denied", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    assert sweep_stale_segments(str(tmp_path)) == []
    assert protected.exists()


_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_SH)
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_locked_segment_is_not_swept_whatever_pid_its_name_carries(tmp_path):
    """As a job in a container that shares /dev/shm but not PIDs sees another's file:
    the pid in the name is dead here, but its creator is alive and holds the lock."""
    seg = tmp_path / _legacy_name(_dead_pid())
    _make_file(seg)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(seg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sweep_stale_segments(str(tmp_path)) == []
        assert seg.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert sweep_stale_segments(str(tmp_path)) == [seg.name], "a dead holder's file stays"


# ------------------------------------------------- jobs beside other users' files


def _serve(rank, world_size, steps=8, n=1000 + 17, warmup_allocs=0):
    """Streams ``steps`` steps through a mailbox and checks every byte; ``warmup_allocs``
    allocations first, a pause after each, give a watcher time to see names."""
    t = HostTransport(dist.group.WORLD, timeout_s=30)
    for _ in range(warmup_allocs):
        t.alloc(64)
        time.sleep(0.3)
    box = Mailbox(t, slot_bytes=8 * n, per_source=True, name="test stream")
    stream_through_mailbox(t, box, rank, world_size, steps, n)
    t.barrier()
    t.close()


def test_a_job_starts_and_serves_beside_entries_it_cannot_remove():
    """Another user's entries under the prefix, old and named by a dead pid: a
    directory (which even root cannot unlink) and, as root, a file of another uid."""
    made = [os.path.join(SHM, _legacy_name(_dead_pid())) for _ in range(2)]
    os.mkdir(made[0])
    _make_file(os.path.join(made[0], "inside"))
    os.utime(made[0], (LONG_AGO, LONG_AGO))
    _make_file(made[1], uid=OTHER_UID if os.geteuid() == 0 else None)
    try:
        if os.geteuid() == 0:
            os.chown(made[0], OTHER_UID, -1)
        run_ranks(_serve, 2, deadline_s=120)
        assert os.path.isdir(made[0])
        if os.geteuid() == 0:
            assert os.path.exists(made[1]), "another user's file was removed"
    finally:
        os.unlink(os.path.join(made[0], "inside"))
        os.rmdir(made[0])
        if os.path.exists(made[1]):
            os.unlink(made[1])


_LEGACY_RE = re.compile(r"^torchrec_pgas\.([0-9a-f]+)\.(\d+)\.r(\d+)\.p(\d+)$")


class _Watcher(threading.Thread):
    """Watches /dev/shm and creates, first, the names it predicts a job will use next:
    for any name with a counter, the same name with the next 50 counters."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.seen = set()
        self.made = set()

    def run(self) -> None:
        while not self.stop.is_set():
            for name in os.listdir(SHM):
                if not name.startswith("torchrec_pgas.") or name in self.made or name in self.seen:
                    continue
                self.seen.add(name)
                m = _LEGACY_RE.match(name)
                if not m:
                    continue
                job, counter, rank, pid = m.groups()
                for c in range(int(counter) + 1, int(counter) + 51):
                    guess = os.path.join(SHM, _legacy_name(int(pid), c, int(rank), job))
                    try:
                        os.close(os.open(guess, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666))
                        self.made.add(os.path.basename(guess))
                    except OSError:
                        pass


def test_a_watcher_that_creates_predicted_names_first_does_not_stop_a_job():
    watcher = _Watcher()
    watcher.start()
    try:
        run_ranks(_serve, 2, deadline_s=120, warmup_allocs=3)
    finally:
        watcher.stop.set()
        watcher.join()
        for name in watcher.made:
            os.unlink(os.path.join(SHM, name))
    assert watcher.seen, "the watcher never saw a segment: the test proves nothing"


# ------------------------------------------------------ a rank dead in a lock


def _dies_holding_a_lock(rank, world_size, op):
    t = HostTransport(dist.group.WORLD, timeout_s=1.0)
    sig = t.alloc_signals(world_size)
    if rank == 1:
        # The record rank 0 waits on (its own, index 1), or the one it sets (rank 1's,
        # index 0): rank 1 takes its lock and dies holding it.
        addr = t._record(sig, 0, 1) if op == "wait" else t._record(sig, 1, 0)
        libc = ctypes.CDLL(ctypes.util.find_library("pthread") or ctypes.util.find_library("c"))
        libc.pthread_spin_trylock.argtypes = [ctypes.c_void_p]
        assert libc.pthread_spin_trylock(addr) == 0
        t.barrier()
        os._exit(0)
    t.barrier()
    start = time.monotonic()
    if op == "wait":
        with pytest.raises(
            PgasTimeoutError,
            match=r"rank 0: timed out after 1.0 s waiting for the ids of step 1 from rank 1 "
            r"\(the lock of signal 1 stayed taken",
        ):
            t.wait(sig, 1, 1, "the ids of step 1 from rank 1")
    else:
        with pytest.raises(
            PgasTimeoutError,
            match=r"rank 0: timed out after 1.0 s waiting for the lock of signal 0 of rank 1",
        ):
            t.signal(sig, 1, 0, 1)
    assert time.monotonic() - start < 5
    os._exit(0)  # the group is broken: no barrier, no teardown


@pytest.mark.parametrize("op", ["wait", "signal"])
def test_a_rank_that_dies_holding_a_signal_lock_times_its_peer_out(op):
    run_ranks(_dies_holding_a_lock, 2, deadline_s=90, op=op)


# ------------------------------------------------------ a destroyed process group


def _serve_after_destroy(rank, world_size):
    tables = make_tables(3, seed=7)
    torch.manual_seed(7)  # the same weights on every rank
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    placement = {"t0": pgas_tw(0), "t1": pgas_tw(1), "t2": pgas_row_wise(compute_kernel="fused")}
    model = shard(ref, placement, world_size, PgasEmbeddingBagCollectionSharder())
    kjt = random_kjt(tables, batch_size=3 + rank, seed=rank)
    expected = reference_pooled(tables, ref.state_dict(), kjt, row_wise=["t2"])
    assert_close_to_reference(model(kjt).to_dict(), expected)
    dist.destroy_process_group()
    with pytest.raises(PgasError, match=rf"rank {rank}: the process group of .* was destroyed"):
        model(random_kjt(tables, batch_size=2 + rank, seed=10 + rank)).to_dict()
    os._exit(0)  # the group is gone: nothing to tear down


def test_a_model_raises_on_every_rank_after_its_process_group_is_destroyed():
    run_ranks(_serve_after_destroy, 2, deadline_s=120)


# ------------------------------------------------------ a rank that cannot map a file


def _job_files(job: str) -> list:
    return [name for name in os.listdir(SHM) if name.startswith(f"torchrec_pgas.{job}.")]


def _one_rank_cannot_map(rank, world_size):
    t = HostTransport(dist.group.WORLD, timeout_s=30)
    open_ = os.open

    def refuse_peers(path, flags, *args, **kwargs):
        # Creating its own file works; opening a peer's (rank 0's, first) does not.
        if os.path.basename(os.fspath(path)).startswith("torchrec_pgas.") and not flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return open_(path, flags, *args, **kwargs)

    if rank == 1:
        os.open = refuse_peers
    start = time.monotonic()
    try:
        with pytest.raises(PgasError, match=r"rank 1: cannot map the segment of rank 0: .*Permission denied"):
            t.alloc(1000 + 17 * rank)
    finally:
        os.open = open_
    assert time.monotonic() - start < 10, "a rank waited for its failed peer"
    t.barrier()  # every rank has raised and cleaned up: the group still works
    assert _job_files(t._job) == [], f"rank {rank}: a failed allocation left {_job_files(t._job)} in /dev/shm"
    t.barrier()  # both have looked before either allocates again
    # The transport still serves once the cause is gone.
    buf = t.alloc(64)
    t.put(buf, 1 - rank, 0, torch.full((8,), rank, dtype=torch.uint8))
    t.barrier()
    assert buf.local[:8].tolist() == [1 - rank] * 8
    t.close()


def test_a_rank_that_cannot_map_a_file_makes_every_rank_raise_and_leaves_no_file():
    run_ranks(_one_rank_cannot_map, 2, deadline_s=60)
