"""Where the kernels read a step's number: a word in device memory, not an argument.

A CUDA graph replays its kernels with the arguments they were captured with, so a
step number passed as an argument would be the captured step at every replay. The
device exchanges therefore keep their step counters in a small device tensor (the
*clock*, one word per phase of a step) that the phase's kernels read and advance in
stream order; the host passes only where to read (``StepRef``) and what is the same
at every step (sizes, the number of programs to expect per step).

Clock words (int64), each the last step of its phase that the device has taken:

* ``SEND``: ticked by ``ids_header`` (one program) before ``put_signal`` reads it.
* ``RECV``: ticked by ``bag_offsets``' last program, which also writes the step into
  the step's record (``record[at + RECORD_STEP]``), where the step's later kernels
  read it (possibly on other streams, after the next receive has ticked).
* ``OUT``: ticked by ``output_take``'s last program; ``rows_put`` and ``lookup_put``,
  enqueued before it, read ``OUT + 1``.
* ``EXPECTED``: the output programs this rank expects from every owner so far,
  advanced by ``output_take`` by the step's count.
* ``GRAD``: ticked by the backward's last wait (``signal_wait``); not at world size 1
  with the fused update, whose backward has no exchange.
"""

from typing import Dict, NamedTuple

import torch
import triton
import triton.language as tl

SEND = 0
RECV = 1
OUT = 2
EXPECTED = 3
GRAD = 4
WORDS = 8

#: Word of a step's record (after the error record) that holds the ids step.
RECORD_STEP = 4


class StepRef(NamedTuple):
    """Where a kernel reads a step: ``word[0] + add`` (``word``: an int64 device tensor,
    usually one word of a clock)."""

    word: torch.Tensor
    add: int = 0


_ZEROS: Dict[torch.device, torch.Tensor] = {}


def fixed(step: int, device: torch.device) -> StepRef:
    """A ``StepRef`` to a step known when the launch is enqueued (the transport's own
    barriers and probes, which are not captured): a zero word plus ``step``."""
    zero = _ZEROS.get(device)
    if zero is None:
        zero = _ZEROS[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return StepRef(zero, step)


def clock(device: torch.device) -> torch.Tensor:
    """A zeroed clock (int64 ``[WORDS]``)."""
    return torch.zeros(WORDS, dtype=torch.int64, device=device)


def at(clock_: torch.Tensor, word: int, add: int = 0) -> StepRef:
    """``clock_[word] + add``."""
    return StepRef(clock_[word : word + 1], add)


@triton.jit
def read_step(step_ptr, add):
    """The step a ``StepRef`` names (a relaxed GPU-scope read: the word was written
    earlier in stream order, or by an earlier program that is done)."""
    return tl.load(step_ptr) + add
