"""Stream-ordered wait: the kernels after it see what the peers put before signalling.

One program waits for every peer in turn (one launch, whatever the number of peers).
A wait that does not finish within ``timeout_ns`` leaves an error record for the host
and lets the stream go on (no hang); the waits after it are not made. With
``record``, the error record is then copied into it, so that the host reads a step's
headers and its error record in one read-back.

Buffers:
    sig:     int64 [world]  this rank's signal array, one word per peer
    peers:   int32 [P]      the peers to wait for
    err:     int64 [4]      error record (see ``signals.py``)
    record:  int64 [at + 4] out (with COPY): the error record at ``at``
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher
from torchrec_pgas.kernels.signals import wait_ge


@triton.jit(do_not_specialize=["num_peers", "target", "what", "timeout_ns", "at"])
def signal_wait_kernel(
    sig_ptr,
    peers_ptr,
    err_ptr,
    record_ptr,
    num_peers: tl.int64,
    target: tl.int64,
    what: tl.int64,
    timeout_ns: tl.int64,
    at: tl.int64,
    COPY: tl.constexpr,
):
    ok = num_peers >= 0
    for i in range(num_peers):
        if ok:
            peer = tl.load(peers_ptr + i)
            ok = wait_ge(sig_ptr + peer, target, timeout_ns, err_ptr, peer, what)
    if COPY:
        # The thread that recorded a timeout stored the words; the others read them.
        tl.debug_barrier()
        words = tl.arange(0, 4)
        tl.store(record_ptr + at + words, tl.load(err_ptr + words))


_launcher = Launcher(signal_wait_kernel)


def signal_wait(
    sig: torch.Tensor,
    peers: torch.Tensor,
    target: int,
    err: torch.Tensor,
    what: int,
    timeout_ns: int,
    record: Optional[torch.Tensor] = None,
    at: int = 0,
) -> None:
    """Enqueues waits for ``sig[q] >= target`` for every ``q`` in ``peers``, then the
    copy of ``err`` into ``record[at : at + 4]`` if ``record`` is given."""
    copy = record is not None
    if peers.numel() or copy:
        _launcher[(1,)](
            sig, peers, err, record if copy else err, peers.numel(), target, what, timeout_ns, at,
            COPY=copy, num_warps=1,
        )
