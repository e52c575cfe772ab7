"""The fused sparse update of one lookup group, second launch: the sums of the partial
sums of ``GROUP`` consecutive blocks of ``row_update`` that one row's run goes through.

A row read by a large share of a batch (the head of Zipf-skewed ids, a feature's
"unknown" value) has its occurrences sorted into a run over thousands of blocks.
``row_update`` sums each block's part in parallel, but one program of ``run_update``
adds up the parts, and every step of that loop waits for its loads: a run over ``B``
blocks cost ``B / CHUNK`` dependent steps. Here a program per group of ``GROUP``
blocks adds the group's parts first, where one run covers the whole group, so that
``run_update`` adds the groups' sums instead: about ``B / (GROUP * CHUNK) + 2 * GROUP /
CHUNK`` steps.

Program ``j`` takes blocks ``j * GROUP ... j * GROUP + GROUP - 1``. A run covers them
all when the group's first block begins with a row whose run began before it and its
last block begins with the same row (the keys are sorted); then every block of the
group holds that row's part at ``partial[2 * c]`` and the program stores their sum,
added ``CHUNK`` blocks at a time in block order, at ``sums[j]``. Other groups store
nothing, and ``run_update`` reads only the sums of groups that a run covers.

Buffers:
    keys:      int32 or int64 [N]  the sorted keys (``update_keys``)
    partial:   float32 ``row_update.partial_shape(N, max_dim)``, rows of ``PITCH``  the
               blocks' sums (``row_update``)
    sums:      float32 ``sums_shape(N, max_dim)``, rows of ``PITCH``  out: the covered
               groups' sums
"""

import torch
import triton
import triton.language as tl

from torchrec_pgas.kernels.launch import Launcher, cdiv
from torchrec_pgas.kernels.row_update import block_positions, dim_block, partial_shape
from torchrec_pgas.kernels.update_keys import sentinel

NUM_WARPS = 1
#: Blocks of ``row_update`` per group (a run covers one where it goes through all of
#: them from an earlier block).
GROUP = 64
#: Elements of the partial sums added at once (``CHUNK`` rows of them), here and in
#: ``run_update``.
TILE = 512


def sums_shape(n: int, max_dim: int) -> tuple:
    """``sums``' shape for ``n`` sorted positions: a row per group, of ``partial``'s pitch."""
    partial_rows, pitch = partial_shape(n, max_dim)
    return cdiv(partial_rows // 2, GROUP), pitch


def chunk_rows(max_dim: int) -> int:
    """Partial sums added at once, for rows of up to ``max_dim`` elements."""
    return max(1, TILE // dim_block(max_dim))


@triton.jit
def add_rows(acc, rows_ptr, lo, hi, STRIDE: tl.constexpr, PITCH: tl.constexpr, d, dim, CHUNK: tl.constexpr):
    """``acc`` ([1, BLOCK_D]) plus rows ``STRIDE * c`` of ``rows_ptr`` (of ``PITCH``
    elements) for ``c`` in ``[lo, hi]``, ``CHUNK`` at a time: in order of ``c`` across
    chunks, the loads of a chunk in flight together."""
    c = lo + tl.arange(0, CHUNK).to(tl.int64)
    for _ in range(lo, hi + 1, CHUNK):
        part = tl.load(
            rows_ptr + (STRIDE * c[:, None]) * PITCH + d[None, :],
            mask=(c[:, None] <= hi) & (d[None, :] < dim[:, None]),
            other=0.0,
        )
        acc += tl.sum(part, axis=0)[None, :]
        c += CHUNK
    return acc


@triton.jit(do_not_specialize=["n", "blocks"])
def run_groups_kernel(
    keys_ptr,
    partial_ptr,
    sums_ptr,
    n: tl.int64,
    blocks: tl.int64,
    SENTINEL: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PITCH: tl.constexpr,
):
    first_block = tl.program_id(0).to(tl.int64) * GROUP
    last_block = first_block + GROUP - 1
    if (first_block > 0) & (last_block < blocks):
        key = tl.load(keys_ptr + first_block * BLOCK)
        covered = (key != SENTINEL) & (tl.load(keys_ptr + first_block * BLOCK - 1) == key)
        covered = covered & (tl.load(keys_ptr + last_block * BLOCK) == key)
        if covered:
            d = tl.arange(0, BLOCK_D)
            every = tl.full([1], PITCH, dtype=tl.int64)
            acc = add_rows(
                tl.zeros([1, BLOCK_D], dtype=tl.float32),
                partial_ptr,
                first_block,
                last_block,
                2,
                PITCH,
                d,
                every,
                CHUNK,
            )
            tl.store(sums_ptr + tl.program_id(0).to(tl.int64) * PITCH + d[None, :], acc, mask=d[None, :] < PITCH)


_launcher = Launcher(run_groups_kernel)


def run_groups(keys: torch.Tensor, partial: torch.Tensor, sums: torch.Tensor, max_dim: int) -> None:
    """Launches one program per group of ``GROUP`` blocks of ``row_update`` (see the
    module docstring)."""
    n = keys.numel()
    if n == 0:
        return
    if sums.stride(0) != partial.stride(0):
        raise ValueError(f"sums' rows ({sums.stride(0)}) must be partial's ({partial.stride(0)})")
    block = block_positions(max_dim)
    blocks = cdiv(n, block)
    _launcher[(cdiv(blocks, GROUP),)](
        keys,
        partial,
        sums,
        n,
        blocks,
        SENTINEL=sentinel(keys.dtype),
        BLOCK=block,
        GROUP=GROUP,
        CHUNK=chunk_rows(max_dim),
        BLOCK_D=dim_block(max_dim),
        PITCH=partial.stride(0),
        num_warps=NUM_WARPS,
    )
