"""The host transport and the mailbox protocol, on real processes."""

import glob
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks, stream_through_mailbox

from torchrec_pgas.transport import Mailbox, PgasTimeoutError
from torchrec_pgas.transport.host import HostTransport

SEGMENTS = "/dev/shm/torchrec_pgas.*"


def _mailbox_stream(rank, world_size, steps, n):
    """Segments are unlinked once mapped, and the mailbox delivers every step intact."""
    t = HostTransport(dist.group.WORLD, timeout_s=30)
    box = Mailbox(t, slot_bytes=8 * n, per_source=True, name="test stream")
    t.barrier()  # every rank has unlinked its own files
    assert not glob.glob(f"/dev/shm/torchrec_pgas.{t._job}.*"), "segments must be unlinked once mapped"
    stream_through_mailbox(t, box, rank, world_size, steps, n)
    box.close()
    t.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_mailbox_delivers_every_step_intact(world_size):
    run_ranks(_mailbox_stream, world_size, steps=40, n=64 * 1024)


def _put_rows(rank, world_size):
    t = HostTransport(dist.group.WORLD, timeout_s=30)
    rows, cols, total = 5, 3, 3 * world_size
    buf = t.alloc(rows * total * 4)
    sig = t.alloc_signals(world_size)
    block = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 100 * rank
    for dest in range(world_size):
        t.put_rows(buf, dest, rank * cols * 4, total * 4, block)
        t.signal(sig, dest, rank, 1)
    for source in range(world_size):
        t.wait(sig, source, 1, "rows")
    out = buf.local.view(torch.float32).view(rows, total)
    expected = torch.cat(
        [torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 100 * s for s in range(world_size)],
        dim=1,
    )
    assert torch.equal(out, expected)
    t.barrier()
    t.close()


def test_put_rows_lands_each_block_at_its_columns():
    run_ranks(_put_rows, 3)


def _timeout(rank, world_size):
    t = HostTransport(dist.group.WORLD, timeout_s=0.5)
    sig = t.alloc_signals(world_size)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(PgasTimeoutError, match=r"rank 0: timed out .* ids of step 1 from rank 1"):
            t.wait(sig, 1, 1, "ids of step 1 from rank 1")
        assert time.monotonic() - start < 5
    t.barrier()
    t.close()


def test_wait_times_out_naming_rank_and_peer():
    run_ranks(_timeout, 2)


def _crash(rank, world_size):
    t = HostTransport(dist.group.WORLD, timeout_s=5)
    for _ in range(3):
        t.alloc(4096)
    t.alloc_signals(4)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t.barrier()


def test_nothing_left_in_dev_shm_after_a_crash():
    before = set(glob.glob(SEGMENTS))
    with pytest.raises(Exception):
        run_ranks(_crash, 2)
    assert set(glob.glob(SEGMENTS)) - before == set()
