"""The fused update's two sorts of a lookup group's ids on the GPU: FBGEMM's
``transpose_embedding_input`` (``fused_update.transpose_sort``, then
``kernels/transposed_ids``) against ``update_keys``, FBGEMM's
``get_unique_indices_with_inverse`` and ``sort_order``. Both are stable sorts of the
same keys, so every array the update reads must be equal, position for position: this
checks the op's layout (its infos, the bits it sorts, the padding's feature) where the
interpreter tests emulate it.

Skipped without a GPU. On the GPU machine:
    python3 -m pytest -q tests/test_gpu_update_sort.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("fbgemm_gpu")

from torchrec_pgas.kernels.sort_order import sort_order  # noqa: E402
from torchrec_pgas.kernels.transposed_ids import transposed_ids  # noqa: E402
from torchrec_pgas.kernels.update_keys import update_keys  # noqa: E402
from torchrec_pgas.sharding.fused_update import sort_positions, transpose_info_bits, transpose_sort  # noqa: E402

GPU = torch.device("cuda", 0)


def _sorted_both_ways(seed: int, table_rows, table_of, bags_per_feature: int, max_len: int, pitch: int, scaled: bool):
    """A group's random ids (empty bags, a hot row per table, the capacity twice the
    ids) sorted both ways; returns the ids' count and each way's arrays."""
    g = torch.Generator().manual_seed(seed)
    first = [sum(table_rows[:t]) for t in range(len(table_rows))]
    rows = sum(table_rows)
    F, B = len(table_of), bags_per_feature
    lengths = torch.randint(0, max_len + 1, (F * B,), generator=g)
    lengths[torch.rand(F * B, generator=g) < 0.2] = 0
    for f in range(F):
        if table_rows[table_of[f]] == 0:  # a table without rows gets no ids
            lengths[f * B : (f + 1) * B] = 0
    offsets = torch.zeros(F * B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ids = int(offsets[-1])
    n = 2 * ids + 5
    per_feature = lengths.view(F, B).sum(1).tolist()
    values = torch.cat(
        [torch.randint(0, max(table_rows[table_of[f]], 1), (per_feature[f],), generator=g) for f in range(F)]
        + [torch.randint(0, 7, (n - ids,), generator=g)]
    )
    values[: ids // 10] = 3
    features = torch.tensor(
        [[first[table_of[f]], (f * 16) % pitch, int(scaled and f % 2 == 0)] for f in range(F)], dtype=torch.int64
    )
    tables = torch.tensor([[first[t], 1000 * t, 8, t] for t in range(len(table_rows)) if table_rows[t]])
    offsets, values, features, tables = (t.to(GPU) for t in (offsets, values, features, tables))

    keys, src = torch.empty(n, dtype=torch.int32, device=GPU), torch.empty(n, dtype=torch.int64, device=GPU)
    scale = torch.empty(n if scaled else 1, device=GPU)
    update_keys(offsets, values, scale, features, keys, src, scale, B, pitch, rows, scaled, False, False)
    order = sort_positions(keys, rows)
    theirs = _outputs(n, scaled)
    sort_order(keys, order, rows, offsets, src, scale, tables, *theirs, scaled, False)

    bits = transpose_info_bits(F, B)
    hash_size_cumsum = torch.tensor([first[table_of[f]] for f in range(F)] + [rows, rows])
    sorted_keys, infos, offsets_out = transpose_sort(
        hash_size_cumsum.to(GPU), rows, offsets, values.to(torch.int32), B, bits
    )
    ours = _outputs(n, scaled)
    transposed_ids(sorted_keys, infos, offsets_out, features, tables, *ours, rows, B, pitch, bits, scaled)
    torch.cuda.synchronize()
    return ids, [t.cpu() for t in theirs], [t.cpu() for t in ours]


def _outputs(n: int, scaled: bool):
    return (
        torch.full((n,), -1, dtype=torch.int32, device=GPU),
        torch.full((n,), -1, dtype=torch.int64, device=GPU),
        torch.full((n if scaled else 1,), float("nan"), device=GPU),
        torch.full((n,), -1, dtype=torch.int32, device=GPU),
    )


@pytest.mark.parametrize(
    "table_rows,table_of,bags_per_feature,max_len",
    [
        ([50, 0, 7], [0, 2, 0, 1], 33, 6),  # features sharing a table, one without rows
        ([1000] * 8, list(range(8)), 4096, 40),  # R1's shape, smaller tables
        ([10, 3_000_000, 12], [1, 0, 2, 1], 65536, 3),  # 17 bits of bags, a large table
    ],
)
@pytest.mark.parametrize("scaled", [False, True])
def test_transpose_sort_equals_the_other_sort(table_rows, table_of, bags_per_feature, max_len, scaled):
    ids, theirs, ours = _sorted_both_ways(7, table_rows, table_of, bags_per_feature, max_len, 128, scaled)
    assert ids > 0
    assert torch.equal(ours[0], theirs[0]), "keys, with the sentinel past the ids"
    assert torch.equal(ours[1][:ids], theirs[1][:ids]), "gradient rows"
    assert torch.equal(ours[3][:ids], theirs[3][:ids]), "tables"
    if scaled:
        assert torch.equal(ours[2][:ids], theirs[2][:ids]), "scales"
