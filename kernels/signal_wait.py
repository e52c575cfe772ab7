"""Stream-ordered wait: the kernels after it see what the peers put before signalling.

One program per peer to wait for. A wait that does not finish within ``timeout_ns``
leaves an error record for the host and lets the stream go on (no hang).

Buffers:
    sig:    int64 [world]  this rank's signal array, one word per peer
    peers:  int32 [P]      the peers to wait for
    err:    int64 [4]      error record (see ``signals.py``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher
from torchrec_pgas.kernels.signals import wait_ge


@triton.jit(do_not_specialize=["target", "what", "timeout_ns"])
def signal_wait_kernel(sig_ptr, peers_ptr, err_ptr, target, what, timeout_ns):
    peer = tl.load(peers_ptr + tl.program_id(0))
    wait_ge(sig_ptr + peer, target, timeout_ns, err_ptr, peer, what)


_launcher = Launcher(signal_wait_kernel)


def signal_wait(
    sig: torch.Tensor,
    peers: torch.Tensor,
    target: int,
    err: torch.Tensor,
    what: int,
    timeout_ns: int,
) -> None:
    """Enqueues waits for ``sig[q] >= target`` for every ``q`` in ``peers``."""
    if peers.numel():
        _launcher[(peers.numel(),)](sig, peers, err, target, what, timeout_ns, num_warps=1)
