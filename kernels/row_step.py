"""The optimizer step of a table row from its summed gradient, shared by the two launches
of the fused sparse update (``row_update`` for runs inside a block of sorted positions,
``run_update`` for runs across blocks), for ``EXACT_SGD`` and ``EXACT_ROWWISE_ADAGRAD``
with fp32 weights, as FBGEMM's fused backward applies them:

* ``SGD``: ``w -= lr * g``.
* ``ROWWISE_ADAGRAD``: ``m += mean((g + wd * w)^2)`` with L2 weight decay (mode 1), else
  ``mean(g^2)``; ``mult = lr / (sqrt(m) + eps)``; ``w = c * w - mult * g`` with
  ``c = 1 - mult * wd`` (L2), ``1 - lr * wd`` (decoupled, mode 2) or 1.

The hyper-parameters are read from device memory, not passed at launch: a captured
step then applies the learning rate of each replay (a schedule's), not its capture's.

Buffers:
    hyper:     float32 [HYPER_WORDS]  the learning rate, eps and weight decay
"""

from typing import NamedTuple

import triton
import triton.language as tl

#: ``OPTIM`` values.
SGD, ROWWISE_ADAGRAD = 0, 1
#: Words of ``hyper``: the learning rate, eps, the weight decay.
LEARNING_RATE, EPS, WEIGHT_DECAY = 0, 1, 2
HYPER_WORDS = 3


class StepRule(NamedTuple):
    """What both launches of the update are compiled for: the rule (``SGD`` or
    ``ROWWISE_ADAGRAD``) and FBGEMM's weight decay mode (0 none, 1 L2, 2 decoupled;
    weight decay applies to ``ROWWISE_ADAGRAD`` only). The values the rule reads are
    ``hyper``'s."""

    optim: int
    weight_decay_mode: int = 0


@triton.jit
def hyper_parameters(hyper_ptr):
    """The learning rate, eps and weight decay (read once per program, before the
    rows: a load in the step would wait behind the rows' sums)."""
    # The words of LEARNING_RATE, EPS, WEIGHT_DECAY.
    return tl.load(hyper_ptr), tl.load(hyper_ptr + 1), tl.load(hyper_ptr + 2)


@triton.jit
def row_step(
    w,
    g,
    dim,
    state,
    learning_rate,
    eps,
    weight_decay,
    weight_decay_mode,
    OPTIM: tl.constexpr,
):
    """The rows ``w`` (fp32 [R, BLOCK_D], zero past ``dim``) and their optimizer state
    (``state``, fp32 [R]; unused by ``SGD``) after the step of their summed gradients
    ``g`` (the same shape as ``w``). The caller loads and stores both, so that their
    loads are in flight with the gradient's."""
    if OPTIM == 0:
        w = w - learning_rate * g
    else:
        g2 = g
        if weight_decay_mode == 1:
            g2 = g + weight_decay * w
        g_avg_square = tl.sum(g2 * g2, axis=1) / tl.maximum(dim, 1).to(tl.float32)
        state = state + g_avg_square
        multiplier = learning_rate / (tl.sqrt_rn(state) + eps)
        correction = tl.full(multiplier.shape, 1.0, tl.float32)
        if weight_decay_mode == 1:
            correction = 1.0 - multiplier * weight_decay
        elif weight_decay_mode == 2:
            correction = correction - learning_rate * weight_decay
        w = correction[:, None] * w - multiplier[:, None] * g
    return w, state
