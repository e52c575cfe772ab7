"""Stream-ordered wait: the kernels after it see what the peers put before signalling.

One program waits for every peer in turn (one launch, whatever the number of peers).
A wait that does not finish within ``timeout_ns`` leaves an error record for the host
and lets the stream go on (no hang); the waits after it are not made.

Buffers:
    sig:     int64 [world]  this rank's signal array, one word per peer
    peers:   int32 [P]      the peers to wait for
    err:     int64 [4]      error record (see ``signals.py``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher
from torchrec_pgas.kernels.signals import wait_ge


@triton.jit(do_not_specialize=["num_peers", "target", "what", "timeout_ns"])
def signal_wait_kernel(
    sig_ptr,
    peers_ptr,
    err_ptr,
    num_peers: tl.int64,
    target: tl.int64,
    what: tl.int64,
    timeout_ns: tl.int64,
):
    ok = num_peers >= 0
    for i in range(num_peers):
        if ok:
            peer = tl.load(peers_ptr + i)
            ok = wait_ge(sig_ptr + peer, target, timeout_ns, err_ptr, peer, what)


_launcher = Launcher(signal_wait_kernel)


def signal_wait(
    sig: torch.Tensor, peers: torch.Tensor, target: int, err: torch.Tensor, what: int, timeout_ns: int
) -> None:
    """Enqueues waits for ``sig[q] >= target`` for every ``q`` in ``peers``."""
    if peers.numel():
        _launcher[(1,)](sig, peers, err, peers.numel(), target, what, timeout_ns, num_warps=1)
