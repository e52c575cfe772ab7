"""The fused sparse update of one lookup group, third launch: the optimizer step
(``row_step``) of the rows whose sorted occurrences cross blocks of ``row_update``.

Program ``p`` checks blocks ``p * BLOCKS ...`` at once and, for each block ``b`` of
them, steps the row whose run begins in ``b`` and goes on past it, if there is one (at
most one: the block's last). Most blocks have none: a program per block spent its time
on the programs' count alone at large batches. The row's sum is the block's partial sum
(``partial[2 * b + 1]``) plus those of the following blocks the run goes through
(``partial[2 * c]`` for every block ``c`` that begins with the row, found by a binary
search of the blocks' first keys, for all the program's owners at once): the blocks
before the first group of ``run_groups.GROUP`` blocks that the run covers, the covered
groups' sums (``sums[j]``, from ``run_groups``), then the blocks after them, each
``CHUNK`` rows at a time with no dependent loads between the rows of a chunk. A row read
by a large share of the batch thus costs a few steps of one program after ``row_update``
and ``run_groups`` summed its occurrences in parallel.

Nothing is updated for a bad step (``verdict``, see ``row_update``).

Buffers:
    keys:      int32 or int64 [N]  the sorted keys (``update_keys``)
    table_index: int32 [N]  each sorted position's table, its row of ``tables``
               (``sort_order``)
    tables:    int64 [T, TABLE_WORDS]  per table of the group that has rows: its first
               row, weights offset, dim and optimizer state offset (``sort_order``)
    weights:   float32 [...]  the group's weights, in/out
    state:     float32 [...]  the row-wise optimizer state, in/out
    partial:   float32 ``partial_shape(N, max_dim)``, rows of ``PARTIAL_PITCH``  the blocks'
               sums (``row_update``)
    sums:      float32 ``run_groups.sums_shape(N, max_dim)``, rows of ``PARTIAL_PITCH``
               the sums of the groups of blocks that one run covers (``run_groups``)
    verdict:   int64 [1]  nonzero for a bad step (``step_verdict``)
    hyper:     float32 [HYPER_WORDS]  the optimizer's learning rate, eps and weight
               decay (``row_step``)
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels import run_groups
from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.row_step import StepRule, hyper_parameters, row_step
from torchrec_pgas.kernels.row_update import block_positions, dim_block
from torchrec_pgas.kernels.sort_order import TABLE_WORDS, row_place
from torchrec_pgas.kernels.update_keys import sentinel

NUM_WARPS = 1
#: Blocks of ``row_update`` a program checks at once (a power of 2).
BLOCKS = 8


@triton.jit(do_not_specialize=["n", "blocks", "search_steps", "weight_decay_mode"])
def run_update_kernel(
    keys_ptr,
    table_index_ptr,
    tables_ptr,
    weights_ptr,
    state_ptr,
    partial_ptr,
    sums_ptr,
    verdict_ptr,
    n: tl.int64,
    blocks: tl.int64,
    search_steps: tl.int64,
    hyper_ptr,
    weight_decay_mode: tl.int64,
    OPTIM: tl.constexpr,
    SENTINEL: tl.constexpr,
    TABLE_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTIAL_PITCH: tl.constexpr,
):
    good = tl.load(verdict_ptr) == 0
    d = tl.arange(0, BLOCK_D)
    one = tl.arange(0, 1).to(tl.int64)
    # Which of the program's blocks own a run (their last key goes on into the next
    # block and did not come from the previous one), all read at once: most own none.
    first_block = tl.program_id(0).to(tl.int64) * BLOCKS
    g = first_block + tl.arange(0, BLOCKS)
    begin = g * BLOCK
    end = tl.minimum(begin + BLOCK, n)
    there = begin < n
    first = tl.load(keys_ptr + begin, mask=there, other=SENTINEL)
    before = tl.load(keys_ptr + begin - 1, mask=there & (g > 0), other=SENTINEL)
    key = tl.load(keys_ptr + end - 1, mask=there, other=SENTINEL)
    following = tl.load(keys_ptr + end, mask=there & (end < n), other=SENTINEL)
    owners = there & (key != SENTINEL) & (following == key) & ~((before == first) & (key == first)) & good
    if tl.max(owners.to(tl.int32), axis=0) > 0:
        learning_rate, eps, weight_decay = hyper_parameters(hyper_ptr)
        # The last block that begins with each owner's row (block g + 1 does), searched
        # for every owner of the program at once: one chain of dependent loads.
        lo = g + 1
        hi = tl.where(owners, blocks - 1, lo)
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            up = tl.load(keys_ptr + mid * BLOCK, mask=owners & (mid <= hi), other=SENTINEL) == key
            lo = tl.where(up, mid, lo)
            hi = tl.where(up, hi, mid - 1)
        lane = tl.arange(0, BLOCKS)
        for i in range(BLOCKS):
            if tl.sum(tl.where(lane == i, owners.to(tl.int32), 0), axis=0) > 0:
                # Block b owns a run: its last key's, which goes on to block run_end.
                b = first_block + i
                run_end = tl.sum(tl.where(lane == i, lo, 0), axis=0)
                last = tl.minimum(b * BLOCK + BLOCK, n) - 1 + one
                last_key = tl.load(keys_ptr + last)
                # True; a mask of loaded data keeps the row accesses vectorized.
                owner = last_key != SENTINEL
                table = tl.load(table_index_ptr + last, mask=owner, other=0)
                at, dim, state_at = row_place(tables_ptr, table, last_key, owner, TABLE_WORDS)
                inside = owner[:, None] & (d[None, :] < dim[:, None])
                acc = tl.load(partial_ptr + (2 * b + 1) * PARTIAL_PITCH + d[None, :], mask=inside, other=0.0)
                # The blocks up to the first group after b, the groups the run covers
                # (``run_groups`` summed them), then the blocks after those.
                first_group = (b + GROUP) // GROUP
                last_group = (run_end + 1) // GROUP - 1
                head_end = tl.minimum(run_end, first_group * GROUP - 1)
                acc = run_groups.add_rows(acc, partial_ptr, b + 1, head_end, 2, PARTIAL_PITCH, d, dim, CHUNK)
                acc = run_groups.add_rows(acc, sums_ptr, first_group, last_group, 1, PARTIAL_PITCH, d, dim, CHUNK)
                tail = tl.maximum(head_end + 1, (last_group + 1) * GROUP)
                acc = run_groups.add_rows(acc, partial_ptr, tail, run_end, 2, PARTIAL_PITCH, d, dim, CHUNK)
                w_ptr = weights_ptr + at[:, None] + d[None, :]
                w = tl.load(w_ptr, mask=inside, other=0.0)
                state = tl.zeros([1], dtype=tl.float32)
                if OPTIM != 0:
                    state = tl.load(state_ptr + state_at, mask=owner, other=0.0)
                w, state = row_step(
                    w,
                    acc,
                    dim,
                    state,
                    learning_rate,
                    eps,
                    weight_decay,
                    weight_decay_mode,
                    OPTIM,
                )
                tl.store(w_ptr, w, mask=inside)
                if OPTIM != 0:
                    tl.store(state_ptr + state_at, state, mask=owner)


_launcher = Launcher(run_update_kernel)


def run_update(
    keys: torch.Tensor,
    table_index: torch.Tensor,
    tables: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    partial: torch.Tensor,
    sums: torch.Tensor,
    verdict: torch.Tensor,
    hyper: torch.Tensor,
    max_dim: int,
    rule: StepRule,
) -> None:
    """Launches one program per ``BLOCKS`` blocks of ``row_update`` (see the module
    docstring)."""
    n = keys.numel()
    if n == 0:
        return
    block, block_d = block_positions(max_dim), dim_block(max_dim)
    blocks = cdiv(n, block)
    _launcher[(cdiv(blocks, BLOCKS),)](
        keys,
        table_index,
        tables,
        weights,
        state,
        partial,
        sums,
        verdict,
        n,
        blocks,
        max(blocks, 1).bit_length(),
        hyper,
        rule.weight_decay_mode,
        OPTIM=rule.optim,
        SENTINEL=sentinel(keys.dtype),
        TABLE_WORDS=TABLE_WORDS,
        BLOCK=block,
        BLOCKS=BLOCKS,
        GROUP=run_groups.GROUP,
        CHUNK=run_groups.chunk_rows(max_dim),
        BLOCK_D=block_d,
        PARTIAL_PITCH=partial.stride(0),
        num_warps=NUM_WARPS,
    )
