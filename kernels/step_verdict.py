"""Whether a training step is bad, decided once for every launch of its fused update
(``row_update``, ``run_update``, each lookup group's): a source's header in ``record``
is not ``OK``, the step's error record holds an error, or the transport's error record
(``err``) holds one, such as the backward's wait for the gradients that timed out. A
bad step's outputs were NaN and the host raises for it; nothing is updated for it.

It runs in the backward, after the waits of the step: the update's ids were keyed and
sorted in the forward (``update_keys``), before the waits that may still fail. One
verdict for all the launches, so that an error another stream's wait records meanwhile
cannot update part of a step.

Buffers:
    record:    int64 [S * HEADER_WORDS + 5]  the step's headers, then its error record
               (and the ids step, not read here)
    err:       int64 [4]  the transport's error record (see ``signals.py``)
    verdict:   int64 [1]  out: nonzero for a bad step
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Status
from torchrec_pgas.kernels.launch import Launcher


@triton.jit(do_not_specialize=["num_sources"])
def step_verdict_kernel(
    record_ptr,
    err_ptr,
    verdict_ptr,
    num_sources: tl.int64,
    HEADER_WORDS: tl.constexpr,
    OK: tl.constexpr,
):
    bad = (tl.load(record_ptr + num_sources * HEADER_WORDS) != 0).to(tl.int64)
    bad |= (tl.load(err_ptr) != 0).to(tl.int64)
    for q in range(num_sources):
        bad |= (tl.load(record_ptr + q * HEADER_WORDS) != OK).to(tl.int64)
    tl.store(verdict_ptr, bad)


_launcher = Launcher(step_verdict_kernel)


def step_verdict(
    record: torch.Tensor,
    err: torch.Tensor,
    verdict: torch.Tensor,
    num_sources: int,
) -> None:
    """Launches one program (see the module docstring)."""
    _launcher[(1,)](
        record,
        err,
        verdict,
        num_sources,
        HEADER_WORDS=HEADER_WORDS,
        OK=Status.OK.value,
        num_warps=1,
    )
