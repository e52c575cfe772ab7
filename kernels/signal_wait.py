"""Stream-ordered wait: the kernels after it see what the peers put before signalling.

One program waits for every peer in turn (one launch, whatever the number of peers).
A wait that does not finish within ``timeout_ns`` leaves an error record for the host
and lets the stream go on (no hang); the waits after it are not made.

Buffers:
    sig:     int64 [world]  this rank's signal array, one word per peer
    peers:   int32 [P]      the peers to wait for
    err:     int64 [4]      error record (see ``signals.py``)
    step:    int64 [1]      the target is ``(step[0] + step_add) * per_step``; with
                            ``TICK``, ``step[0]`` becomes ``step[0] + step_add`` after
                            the waits (``step_clock``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher
from torchrec_pgas.kernels.signals import wait_ge
from torchrec_pgas.kernels.step_clock import StepRef, read_step


@triton.jit(do_not_specialize=["num_peers", "step_add", "per_step", "what", "timeout_ns"])
def signal_wait_kernel(
    sig_ptr,
    peers_ptr,
    err_ptr,
    step_ptr,
    num_peers: tl.int64,
    step_add: tl.int64,
    per_step: tl.int64,
    what: tl.int64,
    timeout_ns: tl.int64,
    TICK: tl.constexpr,
):
    step = read_step(step_ptr, step_add)
    target = step * per_step
    ok = num_peers >= 0
    for i in range(num_peers):
        if ok:
            peer = tl.load(peers_ptr + i)
            ok = wait_ge(sig_ptr + peer, target, timeout_ns, err_ptr, peer, what)
    if TICK:
        tl.store(step_ptr, step)


_launcher = Launcher(signal_wait_kernel)


def signal_wait(
    sig: torch.Tensor,
    peers: torch.Tensor,
    step: StepRef,
    err: torch.Tensor,
    what: int,
    timeout_ns: int,
    *,
    per_step: int = 1,
    tick: bool = False,
) -> None:
    """Enqueues waits for ``sig[q] >= step * per_step`` for every ``q`` in ``peers``;
    with ``tick``, then stores the step into its word (even with no peer to wait for)."""
    if peers.numel() or tick:
        _launcher[(1,)](
            sig,
            peers,
            err,
            step.word,
            peers.numel(),
            step.add,
            per_step,
            what,
            timeout_ns,
            TICK=tick,
            num_warps=1,
        )
