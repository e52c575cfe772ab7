"""The fused sparse update of one lookup group, second launch: the optimizer step
(``row_step``) of the rows whose sorted occurrences cross blocks of ``row_update``.

Program ``b`` steps the row whose run begins in block ``b`` and goes on past it, if
there is one (at most one: the block's last): its sum is the block's partial sum
(``partial[2 * b + 1]``) plus those of the following blocks the run goes through
(``partial[2 * c]`` while block ``c`` begins with the row), added ``CHUNK`` blocks at a
time, so that a row read by a large share of the batch costs a few steps of one program
after ``row_update`` summed its occurrences in parallel.

Nothing is updated for a bad step (see ``row_update``).

Buffers:
    keys:      int32 or int64 [N]  the sorted keys (``update_keys``)
    where:     int64 [N, WHERE_WORDS]  each sorted position's row (``row_update``)
    table:     float32 [...]  the group's weights, in/out
    state:     float32 [...]  the row-wise optimizer state, in/out
    partial:   float32 [2 * cdiv(N, ROWS), BLOCK_D]  the blocks' sums (``row_update``)
    record:    int64 [S * 8 + 4]  the step's headers, then its error record
    err:       int64 [4]  the transport's error record
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Status
from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.row_step import row_step
from torchrec_pgas.kernels.row_update import TILE, block_rows, dim_block, step_is_bad
from torchrec_pgas.kernels.update_keys import WHERE_WORDS, sentinel

NUM_WARPS = 1
_OK = Status.OK.value


@triton.jit(do_not_specialize=["n", "num_sources", "weight_decay_mode"])
def run_update_kernel(
    keys_ptr,
    where_ptr,
    table_ptr,
    state_ptr,
    partial_ptr,
    record_ptr,
    err_ptr,
    n: tl.int64,
    num_sources: tl.int64,
    learning_rate: tl.float32,
    eps: tl.float32,
    weight_decay: tl.float32,
    weight_decay_mode: tl.int64,
    OPTIM: tl.constexpr,
    SENTINEL: tl.constexpr,
    WHERE_WORDS: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
    OK: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bad = step_is_bad(record_ptr, err_ptr, num_sources, HEADER_WORDS, OK)
    b = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    one = tl.arange(0, 1).to(tl.int64)
    first_p = b * ROWS
    last_p = tl.minimum(first_p + ROWS, n) - 1
    key = tl.load(keys_ptr + last_p + one)
    following = tl.load(keys_ptr + first_p + ROWS + one, mask=first_p + ROWS < n, other=SENTINEL)
    first = tl.load(keys_ptr + first_p)
    continued = (b > 0) & (tl.load(keys_ptr + first_p - 1, mask=b > 0, other=SENTINEL) == first)
    owner = (key != SENTINEL) & (following == key) & ~(continued & (key == first)) & (bad == 0)
    if tl.max(owner.to(tl.int32), axis=0) > 0:
        at = tl.multiple_of(tl.load(where_ptr + (last_p + one) * WHERE_WORDS), 4)
        dim = tl.multiple_of(tl.load(where_ptr + (last_p + one) * WHERE_WORDS + 1), 4)
        state_at = tl.load(where_ptr + (last_p + one) * WHERE_WORDS + 2)
        inside = owner[:, None] & (d[None, :] < dim[:, None])
        acc = tl.load(partial_ptr + (2 * b + 1) * BLOCK_D + d[None, :], mask=inside, other=0.0)
        c = b + 1 + tl.arange(0, CHUNK).to(tl.int64)
        more = b >= 0
        while more:
            heads = tl.load(keys_ptr + c * ROWS, mask=c * ROWS < n, other=SENTINEL) == key
            part = tl.load(partial_ptr + (2 * c[:, None]) * BLOCK_D + d[None, :], mask=heads[:, None], other=0.0)
            acc += tl.sum(part, axis=0)[None, :]
            more = tl.min(heads.to(tl.int32), axis=0) > 0
            c += CHUNK
        w_ptr = table_ptr + at[:, None] + d[None, :]
        w = tl.load(w_ptr, mask=inside, other=0.0)
        acc = tl.where(inside, acc, 0.0)
        w = row_step(
            w,
            acc,
            dim,
            owner,
            state_ptr,
            state_at,
            learning_rate,
            eps,
            weight_decay,
            weight_decay_mode,
            OPTIM,
        )
        tl.store(w_ptr, w, mask=inside)


_launcher = Launcher(run_update_kernel)


def run_update(
    keys: torch.Tensor,
    where: torch.Tensor,
    table: torch.Tensor,
    state: torch.Tensor,
    partial: torch.Tensor,
    record: torch.Tensor,
    err: torch.Tensor,
    num_sources: int,
    max_dim: int,
    optim: int,
    learning_rate: float,
    eps: float,
    weight_decay: float,
    weight_decay_mode: int,
) -> None:
    """Launches one program per block of ``row_update`` (see the module docstring)."""
    n = keys.numel()
    if n == 0:
        return
    rows, block_d = block_rows(max_dim), dim_block(max_dim)
    _launcher[(cdiv(n, rows),)](
        keys,
        where,
        table,
        state,
        partial,
        record,
        err,
        n,
        num_sources,
        learning_rate,
        eps,
        weight_decay,
        weight_decay_mode,
        OPTIM=optim,
        SENTINEL=sentinel(keys.dtype),
        WHERE_WORDS=WHERE_WORDS,
        HEADER_WORDS=HEADER_WORDS,
        OK=_OK,
        ROWS=rows,
        CHUNK=max(1, TILE // block_d),
        BLOCK_D=block_d,
        num_warps=NUM_WARPS,
    )
