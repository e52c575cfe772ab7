"""The GPU path's bookkeeping kernels, run by Triton's interpreter on the CPU against
plain torch oracles: validation and slot headers at the source (``ids_check``,
``ids_header``), the lookup layout at the owner (``bag_offsets``, ``gather_ids``), and
the rows' final places and the requester's output (``rows_put``, ``lookup_put``,
``output_take``, and ``grads_put`` on the way back, with this process's tensors standing
in for the peers' mappings).

The kernels that call NVSHMEM cannot run here (the interpreter has no extern calls);
``test_gpu.py`` covers them on the device.
"""

import ctypes
import os
import random
import subprocess
import sys
from typing import List, Optional, Tuple

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Capacity, Header, IdsSlotLayout, Status  # noqa: E402
from torchrec_pgas.kernels.put_signal import copy_bytes, grid_size, program_share  # noqa: E402
from torchrec_pgas.kernels.sort_order import row_place  # noqa: E402
from torchrec_pgas.kernels.step_clock import EXPECTED, OUT, StepRef  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    # The interpreter must be chosen before Triton is first imported: in a process of
    # its own.
    def test_kernels_run_by_the_interpreter_match_their_oracles():
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]

else:
    import triton.runtime.interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor

    def _patched(tensor, scope):
        # Triton 3.6's interpreter turns scalar arguments into 1-element arrays, which
        # numpy 2 refuses to convert with int() (so ``range(n)`` fails).
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patched


@pytest.fixture(scope="module")
def k():
    from torchrec_pgas.kernels import (
        bag_offsets,
        gather_ids,
        grads_put,
        ids_check,
        ids_header,
        local_finish,
        lookup_put,
        output_take,
        row_buckets,
        row_update,
        rows_put,
        run_groups,
        run_update,
        sort_order,
        step_verdict,
        transpose_bags,
        transposed_ids,
        update_keys,
    )

    class Kernels:
        pass

    Kernels.ids_check, Kernels.ids_header = ids_check, ids_header
    Kernels.bag_offsets, Kernels.gather_ids, Kernels.rows_put = bag_offsets, gather_ids, rows_put
    Kernels.lookup_put, Kernels.row_buckets, Kernels.grads_put = lookup_put, row_buckets, grads_put
    Kernels.output_take, Kernels.update_keys, Kernels.row_update = output_take, update_keys, row_update
    Kernels.run_update, Kernels.step_verdict, Kernels.sort_order = run_update, step_verdict, sort_order
    Kernels.local_finish, Kernels.run_groups = local_finish, run_groups
    Kernels.transpose_bags, Kernels.transposed_ids = transpose_bags, transposed_ids
    return Kernels


_interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter's process")


def _source_batch(g: torch.Generator, F: int, B: int, rows: torch.Tensor):
    lengths = torch.randint(0, 4, (F * B,), generator=g, dtype=torch.int32)
    lengths[torch.rand(F * B, generator=g) < 0.3] = 0  # empty bags
    per_feature = lengths.view(F, B).sum(1)
    values = (
        torch.cat([torch.randint(0, int(rows[f]), (int(per_feature[f]),), generator=g) for f in range(F)])
        if F
        else torch.zeros(0, dtype=torch.int64)
    )
    return lengths, values


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = lengths.to(torch.int64).cumsum(0)
    return out


def _expected(problem, lengths, values, rows, routed, B, layout, weighted):
    """The oracle: the header the source should send each owner, whose features are
    ``routed[w]`` (positions in the batch)."""
    F = rows.numel()
    offsets = _offsets(lengths)
    ids_per = [sum(int(offsets[(f + 1) * B] - offsets[f * B]) for f in fs) for fs in routed]
    status, detail = Status.OK, (0, 0, 0)
    if problem == "dtype":
        status, detail = Status.BAD_DTYPE, (0, 0, 0)
    elif problem in ("negative", "mismatch"):
        neg = (lengths < 0).nonzero()
        status, detail = Status.BAD_LENGTHS, ((int(neg[0]) // B if len(neg) else -1), 0, 0)
    elif B > layout.batch_capacity or max(ids_per) > layout.ids_capacity:
        status, detail = Status.OVER_CAPACITY, (B, max(ids_per), 0)
    else:
        feature_of = torch.repeat_interleave(torch.arange(F), lengths.view(F, B).sum(1).to(torch.int64))
        bad = ((values < 0) | (values >= rows[feature_of])).nonzero()
        if len(bad):
            p = int(bad[0])
            f = int(feature_of[p])
            status, detail = Status.ID_OUT_OF_RANGE, (f, int(values[p]), int(rows[f]))
    ok = status == Status.OK
    return [
        [int(status), B if B <= layout.batch_capacity else 0, ids_per[w] if ok else 0, int(weighted), *detail, 0]
        for w in range(len(routed))
    ]


def _spoiled(rnd: random.Random, problem: str, rows: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor):
    """A source batch's lengths, ids and offsets with ``problem`` put in (in place
    where it changes one entry): an id past its table or negative, a negative length,
    or one id more than the lengths add up to; any other problem leaves them valid."""
    if problem == "too_large" and values.numel():
        values[rnd.randrange(values.numel())] = int(rows.max()) + rnd.randint(0, 5)
    if problem == "negative_id" and values.numel():
        values[rnd.randrange(values.numel())] = -1
    if problem == "negative":
        lengths[rnd.randrange(lengths.numel())] = -1
    offsets = _offsets(lengths)
    if problem == "mismatch":
        values = torch.cat([values, torch.zeros(1, dtype=torch.int64)])
    return lengths, values, offsets


def _deliver(chunks: torch.Tensor, nbytes: int) -> torch.Tensor:
    """What ``put_signal`` would write: each owner's chunks copied into a buffer of its own."""
    out = torch.zeros(chunks.size(0), nbytes, dtype=torch.uint8)
    for w in range(chunks.size(0)):
        for dst, src, n in chunks[w].tolist():
            assert n >= 0
            if n:
                assert 0 <= dst and dst + n <= nbytes
                ctypes.memmove(out[w].data_ptr() + dst, src, n)
    return out


def _random_route(rnd: random.Random, F: int, W: int):
    """Per owner, its features' positions in the batch: any subset in any order, a
    feature sometimes twice (one feature pooled by two of an owner's tables), an
    owner sometimes with none; and the same as ``feature_runs`` arguments."""
    routed = [[f for f in range(F) if rnd.random() < 0.6] for _ in range(W)]
    for fs in routed:
        if rnd.random() < 0.5:
            rnd.shuffle(fs)
        if fs and rnd.random() < 0.2:
            fs.insert(rnd.randrange(len(fs) + 1), rnd.choice(fs))
    return routed


@_interpreted
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("problem", ["none", "too_large", "negative_id", "negative", "mismatch", "over", "dtype"])
def test_source_slots_match_the_oracle(k, seed, problem):
    """Each owner's slot, as the chunks would fill it: the header, then its features'
    lengths, ids and weights packed in its order; a bad batch as its header alone."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    F, W = rnd.randint(1, 6), rnd.randint(1, 4)
    B = rnd.randint(1, 9) if seed or problem == "negative" else 0  # seed 0: an empty batch
    rows = torch.randint(3, 50, (F,), generator=g)
    routed = _random_route(rnd, F, W)
    lengths, values = _source_batch(g, F, B, rows)
    weighted = bool(seed % 2)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    most = max([1] + [len(fs) for fs in routed])
    layout = IdsSlotLayout.for_batch(most, B, values.numel(), Capacity(1.5), min_batch=1, min_ids=1)
    lengths, values, offsets = _spoiled(rnd, problem, rows, lengths, values)
    if problem == "over":
        layout = IdsSlotLayout(
            max_features=most, batch_capacity=max(1, B - rnd.randint(0, 1)), ids_capacity=max(1, values.numel() // 2)
        )
    verdict = torch.full((2,), k.ids_check.NONE, dtype=torch.int64)
    headers = torch.zeros(W, HEADER_WORDS, dtype=torch.int64)
    # The clock's send word (the last step sent), the sending rank, the generations.
    last, source, depth = rnd.randint(0, 9), rnd.randrange(W), rnd.choice([1, 2, 3])
    step = torch.tensor([last], dtype=torch.int64)
    runs = k.ids_header.feature_runs(routed, torch.device("cpu"))
    chunks = torch.zeros(W, 3 * runs.size(1) + 1, 3, dtype=torch.int64)
    host_problem = (Status.BAD_DTYPE, (0,)) if problem == "dtype" else None
    sent = lengths
    if host_problem is None:
        # Some seeds: int64 lengths, which ids_check narrows into the int32 ones sent.
        wide = seed % 3 == 1
        sent = torch.full_like(lengths, -7) if wide else lengths
        k.ids_check.ids_check(
            values, offsets, lengths.long() if wide else lengths, rows, verdict, B, sent if wide else None
        )
    k.ids_header.ids_header(
        verdict,
        values,
        offsets,
        sent,
        weights,
        rows,
        runs,
        headers,
        chunks,
        B,
        host_problem,
        layout,
        step,
        source,
        depth,
    )
    expected = _expected(problem, lengths, values, rows, routed, B, layout, weighted)
    assert headers.tolist() == expected
    assert verdict.tolist() == [k.ids_check.NONE] * 2, "the verdict is left clean for the next batch"
    assert int(step) == last + 1, "the send takes the next step"
    # The source's slot of the step's generation, in every owner's ``[depth, W]`` slots.
    at = ((last + 1) % depth * W + source) * layout.nbytes
    slots = _deliver(chunks, at + layout.nbytes)[:, at:]
    empty = torch.zeros(0, dtype=torch.int64)
    for w, fs in enumerate(routed):
        slot = slots[w]
        assert layout.header(slot) == Header.decode(expected[w]), w
        if expected[w][0] != Status.OK:
            assert not slot[layout.lengths_offset :].any(), "a bad batch is sent as its header alone"
            continue
        n = expected[w][2]
        assert layout.lengths(slot, len(fs) * B).tolist() == [int(x) for f in fs for x in lengths[f * B : (f + 1) * B]]
        bags = [slice(int(offsets[f * B]), int(offsets[(f + 1) * B])) for f in fs]
        assert torch.equal(layout.ids(slot, n), torch.cat([values[b] for b in bags]) if bags else empty)
        if weighted:
            assert torch.equal(
                layout.weights(slot, n), torch.cat([weights[b] for b in bags]) if bags else empty.float()
            )


@_interpreted
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("problem", ["none", "too_large", "negative_id", "negative", "mismatch", "dtype"])
def test_local_step_keeps_the_lookup_in_bounds_and_reports_as_a_slot_header(k, seed, problem, monkeypatch):
    """A world of one's step (``ids_check`` writing what the lookup reads, then
    ``local_finish``) against the oracle of the sources' slot headers: the lookup gets
    the ids (each bad one as 0) and the offsets clamped to the ids, int32 when narrowed;
    the output is NaN for a bad batch and untouched otherwise; the step's header goes
    to its ring entry, the verdict is left clean and the clock ticks, two steps in a
    row."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    F = rnd.randint(1, 6)
    rows = torch.randint(3, 50, (F,), generator=g)
    # Outputs of many blocks: the one program of local_finish NaNs them all.
    monkeypatch.setattr(k.local_finish, "BLOCK", rnd.choice([4, 16, 1024]))
    verdict = torch.full((2,), k.ids_check.NONE, dtype=torch.int64)
    ring = torch.zeros(4, HEADER_WORDS + 1, dtype=torch.int64)
    last = rnd.randint(0, 9)
    clock = torch.tensor([last], dtype=torch.int64)
    for i in range(2):
        B = rnd.randint(1, 9) if seed or i or problem == "negative" else 0  # an empty batch
        lengths, values = _source_batch(g, F, B, rows)
        lengths, values, offsets = _spoiled(rnd, problem, rows, lengths, values)
        if seed % 2:
            values = values.to(torch.int32)
        weighted = bool(seed % 2)
        layout = IdsSlotLayout.for_batch(F, B, values.numel(), Capacity(2.0))  # never over capacity
        expected = _expected(problem, lengths, values.long(), rows, [list(range(F))], B, layout, weighted)[0]
        is_bad = expected[0] != Status.OK
        out = torch.randn(B, 8, generator=g)
        before = out.clone()
        if problem == "dtype":
            k.local_finish.local_finish(
                out,
                verdict,
                verdict,
                verdict,
                rows,
                clock,
                ring,
                B,
                weighted,
                host_problem=(Status.BAD_DTYPE, (0,)),
            )
        else:
            dtype = rnd.choice([torch.int32, torch.int64])
            ids, safe = torch.full((values.numel(),), -5, dtype=dtype), torch.full((offsets.numel(),), -5, dtype=dtype)
            k.ids_check.ids_check(values, offsets, lengths, rows, verdict, B, sanitized=(ids, safe))
            n = values.numel()
            if not is_bad:
                assert ids.tolist() == values.tolist() and safe.tolist() == offsets.tolist(), "a valid batch as given"
            # Whatever the batch, every bag reads only ids within the batch and below its
            # own table's rows (the offsets it reads may be wrong, never out of bounds).
            safe64 = safe.long()
            assert (safe64 >= 0).all() and (safe64 <= n).all()
            for bag in range(F * B):
                lo, hi = int(safe64[bag]), int(safe64[bag + 1])
                assert (ids[lo:hi].long() < int(rows[bag // B])).all() and (ids[lo:hi] >= 0).all(), bag
            if B:
                starts = safe64[torch.arange(F + 1) * B]
                assert (starts[1:] >= starts[:-1]).all() and int(starts[-1]) == n, "features in order, to the end"
            k.local_finish.local_finish(out, verdict, values, offsets, rows, clock, ring, B, weighted)
        step = last + 1 + i
        assert ring[step % 4].tolist() == expected + [step], "the step's header goes to its ring entry"
        if is_bad:
            assert out.isnan().all(), "a bad step's output is NaN, never a result"
        else:
            assert torch.equal(out, before)
        assert verdict.tolist() == [k.ids_check.NONE] * 2, "the verdict is left clean for the next batch"
        assert int(clock) == step


@_interpreted
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_negative_length_cannot_make_a_bag_read_another_tables_ids(k, dtype):
    """Lengths [2, -1, 2] give offsets [0, 2, 1, 3]: bag 0 (a table of 10 rows) would
    cover id 50, which the third feature's 100 rows allow. The ids and offsets the
    lookup reads keep every bag within ids checked against its own table."""
    rows = torch.tensor([10, 100, 100])
    lengths = torch.tensor([2, -1, 2], dtype=torch.int32)
    offsets, values = _offsets(lengths), torch.tensor([1, 50, 7])
    verdict = torch.full((2,), k.ids_check.NONE, dtype=torch.int64)
    ids, safe = torch.empty(3, dtype=dtype), torch.empty(4, dtype=dtype)
    k.ids_check.ids_check(values, offsets, lengths, rows, verdict, 1, sanitized=(ids, safe))
    assert int(verdict[1]) == 1, "the negative length is found"
    for bag in range(3):
        read = ids[int(safe[bag]) : int(safe[bag + 1])]
        assert (read < int(rows[bag])).all(), (bag, read.tolist(), safe.tolist())


def _checked_oracle(values, offsets, lengths, rows, B):
    """What ``ids_check`` must give, element by element: the verdict, the sanitized ids
    and offsets (each feature starts at the largest of its and the earlier features'
    first offsets, clamped to the ids; an id is checked against the last feature that
    starts at or before it; a bag's offsets stay within its feature's ids)."""
    n, F, bt = values.numel(), rows.numel(), max(B, 1)
    starts, start = [], 0
    for f in range(F):
        start = max(start, min(max(int(offsets[f * B]), 0), n))
        starts.append(start)
    ids, bad_at = [], None
    for p, v in enumerate(values.tolist()):
        owner = [f for f in range(F) if starts[f] <= p]
        limit = int(rows[owner[-1]]) if owner else 0
        bad = v < 0 or v >= limit
        bad_at = p if bad and bad_at is None else bad_at
        ids.append(0 if bad else v)
    negative = [p for p, n_ in enumerate(lengths.tolist()) if n_ < 0]
    safe = []
    for p in range(lengths.numel() + 1):
        g = p // bt
        lo = starts[g] if g < F else n
        hi = starts[g + 1] if g + 1 < F else n
        safe.append(0 if B == 0 else lo if p % bt == 0 else min(max(int(offsets[p]), lo), hi))
    none = 2**62
    return [none if bad_at is None else bad_at, negative[0] if negative else none], ids, safe


@_interpreted
@pytest.mark.parametrize("seed", range(8))
def test_ids_check_over_many_programs_matches_the_element_by_element_oracle(k, seed, monkeypatch):
    """Programs of a few ids each, so that a program's ids and offsets span several
    features, none, or start inside one (the kernel walks only the features of its own
    range), and the features' starts read in chunks: many features, empty ones, tiny
    and empty batches, out-of-range ids and negative lengths, against
    ``_checked_oracle``."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    monkeypatch.setattr(k.ids_check, "BLOCK", rnd.choice([2, 4, 8, 16]))
    # The features' starts read a chunk at a time, the chunks' running maximum carried.
    monkeypatch.setattr(k.ids_check, "MAX_FEATURES", rnd.choice([1, 4, 1024]))
    for _ in range(4):
        F = rnd.randint(1, 40)
        B = rnd.choice([0, 1, 2, rnd.randint(3, 9)])
        rows = torch.randint(1, 30, (F,), generator=g)
        lengths, values = _source_batch(g, F, B, rows)
        problems = ["none", "too_large", "negative_id"] + (["negative"] if B else [])
        lengths, values, offsets = _spoiled(rnd, rnd.choice(problems), rows, lengths, values)
        if values.numel() and rnd.random() < 0.3:
            values[rnd.randrange(values.numel())] = int(rows.max()) + 1
        if rnd.random() < 0.3:  # offsets out of order and past the ids, whatever the lengths say
            offsets = torch.randint(-3, values.numel() + 4, (offsets.numel(),), generator=g)
        verdict = torch.full((2,), k.ids_check.NONE, dtype=torch.int64)
        ids, safe = torch.empty(values.numel(), dtype=torch.int64), torch.empty(offsets.numel(), dtype=torch.int64)
        k.ids_check.ids_check(values, offsets, lengths, rows, verdict, B, sanitized=(ids, safe))
        want_verdict, want_ids, want_safe = _checked_oracle(values, offsets, lengths, rows, B)
        assert verdict.tolist() == want_verdict, (F, B)
        assert ids.tolist() == want_ids, (F, B)
        assert safe.tolist() == want_safe, (F, B)


def test_feature_runs_cut_each_owner_at_every_gap():
    from torchrec_pgas.kernels.ids_header import feature_runs

    runs = feature_runs([[0, 1, 2], [5, 3, 4, 4], []], torch.device("cpu"))
    assert runs.tolist() == [
        [[0, 3], [0, 0], [0, 0]],
        [[5, 1], [3, 2], [4, 1]],
        [[0, 0], [0, 0], [0, 0]],
    ]


@_interpreted
@pytest.mark.parametrize("seed", range(6))
def test_row_buckets_match_fbgemm_block_bucketize(k, seed):
    """``row_buckets`` against FBGEMM's ``block_bucketize_sparse_features`` as TorchRec's
    ``row_wise`` calls it: uneven bags (empty ones too), ids past the tables, with and
    without weights; negative ids land in bounds."""
    import fbgemm_gpu  # noqa: F401

    g = torch.Generator().manual_seed(70 + seed)
    rnd = random.Random(seed)
    F, W, B = rnd.randint(1, 4), rnd.randint(1, 5), rnd.randint(0, 40)
    rows = torch.randint(W, 300, (F,), generator=g)
    lengths = torch.randint(0, 9, (F * B,), generator=g, dtype=torch.int32)
    values = torch.randint(0, 320, (int(lengths.sum()),), generator=g)  # some past the tables
    weights = torch.rand(values.numel(), generator=g) if seed % 2 else None
    block = (rows + W - 1) // W
    offsets = _offsets(lengths)
    got = k.row_buckets.row_buckets(values, offsets, weights, block, W)
    want_lengths, want_values, want_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, values, bucketize_pos=False, sequence=False, block_sizes=block, my_size=W, weights=weights
    )
    assert torch.equal(got[2], want_lengths), "ids per (owner, feature, sample)"
    assert torch.equal(got[1].long(), _offsets(want_lengths).long())
    assert torch.equal(got[0], want_values), "local ids, in their order in each bag"
    if weights is not None:
        assert torch.equal(got[3], want_weights)
    if values.numel():
        values[rnd.randrange(values.numel())] = -rnd.randint(1, 10**12)
        bucketed_values, bucketed_offsets, bucketed_lengths, _ = k.row_buckets.row_buckets(
            values, offsets, weights, block, W
        )
        assert int(bucketed_lengths.sum()) == values.numel(), "every id goes to one owner"
        assert int(bucketed_offsets[-1]) == values.numel()
        torn = k.row_buckets.row_buckets(values[:-1].clone(), offsets, weights, block, W)
        assert int(torn[2].sum()) == values.numel() - 1, "offsets past the ids read nothing"


@_interpreted
@pytest.mark.parametrize("offsets", [[0, -3, 2], [0, 2, 1, 3], [0, 3, 3, 1]])
def test_row_buckets_stay_in_bounds_whatever_the_offsets(k, offsets):
    """Offsets of negative lengths (the send refuses such a batch, after routing it)
    read no id outside the values and write none past the output, even where bags
    overlap and count more ids than there are."""
    n, W = 3, 2
    ids = torch.tensor([-1, -1, 5, 150, 60, -1, -1])  # the values are ids[2:5]
    out = torch.full((n + 4,), -7, dtype=torch.int64)  # the output is out[:n]
    bags = len(offsets) - 1
    lengths = torch.empty(W * bags, dtype=torch.int32)
    grid, meta = (1,), dict(HAS_WEIGHTS=False, BLOCK=k.row_buckets.BLOCK, W_PAD=W, num_warps=4)
    args = [ids[2:5], torch.tensor(offsets), ids, torch.tensor([100]), lengths, lengths, out, out, n, bags, bags, W]
    k.row_buckets.row_buckets_kernel[grid](*args, COUNT=True, **meta)
    args[5] = _offsets(lengths).to(torch.int32)
    k.row_buckets.row_buckets_kernel[grid](*args, COUNT=False, **meta)
    assert (out[n:] == -7).all(), "nothing written past the output"
    assert set(out[:n].tolist()) <= {-7, 5, 50, 60}, "only ids of the values, made local to their block"


@_interpreted
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("problem", ["none", "too_large", "negative_id"])
def test_row_block_routing_reports_the_checked_ids(k, seed, problem):
    """Row-wise: ids are checked as given, then routed bucketed by row block (owner-major
    features, ids local to the block): headers carry the routed counts and the checked
    batch's problem."""
    g = torch.Generator().manual_seed(50 + seed)
    rnd = random.Random(seed)
    F, W, B = rnd.randint(1, 4), rnd.randint(1, 4), rnd.randint(1, 6)
    rows = torch.randint(W, 40, (F,), generator=g)
    lengths, values = _source_batch(g, F, B, rows)
    if problem == "too_large" and values.numel():
        values[rnd.randrange(values.numel())] = int(rows.max()) + rnd.randint(0, 5)
    if problem == "negative_id" and values.numel():
        values[rnd.randrange(values.numel())] = -1
    offsets = _offsets(lengths)
    block = (rows + W - 1) // W
    routed_lengths, routed_values = [], []
    for o in range(W):
        for f in range(F):
            for b in range(B):
                bag = values[offsets[f * B + b] : offsets[f * B + b + 1]]
                mine = bag[(bag // block[f]) == o] - o * block[f]
                routed_lengths.append(mine.numel())
                routed_values.append(mine)
    routed_lengths = torch.tensor(routed_lengths, dtype=torch.int32)
    routed_values = torch.cat(routed_values)
    routed_offsets = _offsets(routed_lengths)
    layout = IdsSlotLayout.for_batch(F, B, values.numel(), Capacity(1.5), min_batch=1, min_ids=1)
    verdict = torch.full((2,), k.ids_check.NONE, dtype=torch.int64)
    headers = torch.zeros(W, HEADER_WORDS, dtype=torch.int64)
    chunks = torch.zeros(W, 4, 3, dtype=torch.int64)
    k.ids_check.ids_check(values, offsets, lengths, rows, verdict, B)
    k.ids_header.ids_header(
        verdict,
        routed_values,
        routed_offsets,
        routed_lengths,
        None,
        rows,
        torch.tensor([[[o * F, F]] for o in range(W)]),
        headers,
        chunks,
        B,
        None,
        layout,
        torch.zeros(1, dtype=torch.int64),
        0,
        1,
        checked=(values, offsets),
    )
    # The problem and its detail, as a single owner of the checked batch would report it.
    (expected,) = _expected(problem, lengths, values, rows, [list(range(F))], B, layout, False)
    ok = expected[0] == Status.OK
    for o in range(W):
        n = int(routed_lengths[o * F * B : (o + 1) * F * B].sum())
        assert headers[o].tolist() == [expected[0], B, n if ok else 0, 0, *expected[4:7], 0], o
        assert chunks[o, :, 2].tolist() == ([F * B * 4, n * 8, 0, 64] if ok else [0, 0, 0, 64]), o


def _owner_slots(
    g: torch.Generator,
    rnd: random.Random,
    S: int,
    F: int,
    weighted: bool = True,
    max_batch: int = 6,
    max_len: int = 3,
    batches: Optional[List[int]] = None,
):
    """The ids slots of one step at an owner of ``F`` features, from ``S`` sources with
    random batch sizes (or ``batches``) and up to ``max_len`` ids per bag (one source, at
    random, reporting a bad batch), and what was sent: per source, its lengths
    ``[F, batch]``, ids, weights and whether it is OK."""
    batches = batches or [rnd.randint(0, max_batch) for _ in range(S)]
    cap = max(batches + [1]) + rnd.randint(0, 2)
    layout = IdsSlotLayout(max_features=F + rnd.randint(0, 2), batch_capacity=cap, ids_capacity=(max_len + 1) * F * cap)
    slots = torch.zeros(S * layout.nbytes, dtype=torch.uint8)
    bad_source = rnd.randrange(S) if rnd.random() < 0.3 else -1
    sent = []
    for s in range(S):
        slot = slots[s * layout.nbytes : (s + 1) * layout.nbytes]
        lengths = torch.randint(0, max_len + 1, (F * batches[s],), generator=g, dtype=torch.int32)
        ids = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
        weights = torch.rand(ids.numel(), generator=g)
        status = Status.ID_OUT_OF_RANGE if s == bad_source else Status.OK
        words = [int(status), batches[s], ids.numel(), int(weighted), 0, 0, 0, 0]
        slot[: 8 * HEADER_WORDS].view(torch.int64)[:] = torch.tensor(words)
        layout.lengths(slot, lengths.numel())[:] = lengths
        layout.ids(slot, ids.numel())[:] = ids
        layout.weights(slot, ids.numel())[:] = weights
        sent.append((lengths.view(F, batches[s]), ids, weights, status == Status.OK))
    return slots, layout, batches, sent


@_interpreted
@pytest.mark.parametrize("seed", range(6))
def test_owner_layout_and_gather_match_the_oracle(k, seed, monkeypatch):
    # Segments of several blocks of bags, and totals looked back at a few at a time.
    monkeypatch.setattr(k.bag_offsets, "BLOCK", [1024, 8, 4, 16, 1024, 2][seed])
    monkeypatch.setattr(k.bag_offsets, "LOOK", [256, 2, 4, 1, 1, 8][seed])
    g = torch.Generator().manual_seed(100 + seed)
    rnd = random.Random(seed)
    S, F = rnd.randint(1, 4), rnd.randint(1, 5)
    slots, layout, batches, sent = _owner_slots(g, rnd, S, F)
    cap = layout.batch_capacity

    # The oracle: bag (f, s, b) in feature-major, source, sample order.
    bag_lengths, ids_in_order, weights_in_order = torch.zeros(F, S, cap, dtype=torch.int64), [], []
    for f in range(F):
        for s, (lengths, ids, weights, ok) in enumerate(sent):
            if not ok:
                continue
            bag_lengths[f, s, : batches[s]] = lengths[f]
            start = int(lengths[:f].sum())
            n = int(lengths[f].sum())
            ids_in_order.append(ids[start : start + n])
            weights_in_order.append(weights[start : start + n])
    expected_offsets = _offsets(bag_lengths.view(-1))

    at = S * HEADER_WORDS
    record = torch.full((at + 5,), -5, dtype=torch.int64)
    scan = k.bag_offsets.scan_state(F, S, layout, slots.device)
    last = rnd.randint(0, 9)
    clock_recv = torch.tensor([last], dtype=torch.int64)  # the clock's RECV word
    for step in (last + 1, last + 2):  # the scan state is left zeroed for the next launch
        # A mailbox of two generations: the step's holds the slots, the other garbage.
        mailbox = torch.full((2, slots.numel()), 0xA5, dtype=torch.uint8)
        mailbox[step % 2] = slots
        offsets = k.bag_offsets.bag_offsets(mailbox.view(-1), S, F, layout, record, scan, clock_recv)
        assert torch.equal(offsets, expected_offsets)
        assert not scan.any()
        assert int(clock_recv) == step and int(record[at + 4]) == step, "the receive takes the next step"
    headers = slots.view(S, layout.nbytes)[:, : 8 * HEADER_WORDS].view(torch.int64).reshape(-1)
    assert torch.equal(record[:at], headers), "the step's headers, in source order"
    assert (record[at : at + 4] == -5).all(), "the error record's words are left"
    ids_all, weights_all = torch.cat(ids_in_order), torch.cat(weights_in_order)
    # One group of every feature, then the features split into two groups.
    first = rnd.randint(0, F)
    for lo, hi in ((0, F), (0, first), (first, F)):
        begin, end = int(offsets[lo * S * cap]), int(offsets[hi * S * cap])
        # int32 ids (the fused update's, whose rows fit it) from a seed on.
        indices = torch.full((end - begin + 3,), -7, dtype=torch.int32 if seed % 2 else torch.int64)
        weights = torch.zeros(end - begin + 3)
        k.gather_ids.gather_ids(
            mailbox.view(-1), record[at + 4 :], S, offsets, indices, weights, lo, hi - lo, layout, True
        )
        assert torch.equal(indices[: end - begin].long(), ids_all[begin:end]), (lo, hi)
        assert torch.equal(weights[: end - begin], weights_all[begin:end]), (lo, hi)
        assert (indices[end - begin :] == -7).all(), "nothing past the group's ids is written"


def _requesters(
    S: int, cap: int, pitch: int, dtype: torch.dtype, rnd: random.Random
) -> Tuple[List[torch.Tensor], List[torch.Tensor], int, torch.Tensor, torch.Tensor]:
    """``S`` requesters' outputs (``cap x pitch``, all -1) and counters of row blocks
    (one per rank of 4), the rank ``me`` the owner counts as, and the addresses a put
    kernel takes: of each output, and of each requester's counter for ``me``."""
    outs = [torch.full((cap, pitch), -1.0, dtype=dtype) for _ in range(S)]
    counters = [torch.zeros(4, dtype=torch.int64) for _ in range(S)]
    me = rnd.randrange(4)
    out_addrs = torch.tensor([o.data_ptr() for o in outs])
    return outs, counters, me, out_addrs, torch.tensor([c.data_ptr() + 8 * me for c in counters])


def _own_output(rows: int, pitch: int, dtype: torch.dtype, joined: bool, rnd: random.Random):
    """This rank's output, all -1: contiguous, or (``joined``) the column slice of a wider
    output that other shardings fill (4-aligned columns on either side, all -7), as the
    module's joined output gives it; and a check that nothing outside it was written."""
    if not joined:
        out = torch.full((rows, pitch), -1.0, dtype=dtype)
        return out, lambda: None
    left, right = 4 * rnd.randint(1, 3), 4 * rnd.randint(0, 3)
    whole = torch.full((rows, left + pitch + right), -7.0, dtype=dtype)
    out = whole[:, left : left + pitch]
    out.fill_(-1.0)

    def outside_untouched() -> None:
        assert (whole[:, :left] == -7.0).all() and (whole[:, left + pitch :] == -7.0).all(), "outside the slice"

    return out, outside_untouched


def _assert_only_block_written(
    out: torch.Tensor, rows: int, cols: slice, counters: torch.Tensor, me: int, programs: int
) -> None:
    """Of ``out`` (all -1 before), only the first ``rows`` rows of columns ``cols`` are
    written, and ``counters`` counted ``programs`` programs, all from requester ``me``."""
    untouched = out.clone()
    untouched[:rows, cols] = -1.0
    assert (untouched == -1.0).all(), "nothing outside the owner's block is written"
    assert int(counters[me]) == programs
    assert int(counters.sum()) == int(counters[me])


@_interpreted
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rows_land_at_their_final_place_and_are_counted(k, seed, dtype):
    rnd = random.Random(seed)
    S = rnd.randint(1, 4)
    dim = rnd.choice([4, 12, 128, 136, 260])  # past BLOCK_D too
    col = 4 * rnd.randint(0, 2)  # columns and the pitch: multiples of 4, as the kernel may assume
    pitch = col + dim + 4 * rnd.randint(0, 2)
    batches = [rnd.choice([0, 1, 31, 32, 33, 70]) for _ in range(S)]
    cap = max(batches + [1])
    src = torch.randn(S * cap, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    headers = torch.zeros(S, HEADER_WORDS, dtype=torch.int64)
    headers[:, 1] = torch.tensor(batches)
    outs, counters, me, out_addrs, cnt_addrs = _requesters(S, cap, pitch, dtype, rnd)
    # This rank's own rows go to its output instead of its slot (or no requester is).
    mine = rnd.randrange(-1, S)
    own, outside_untouched = _own_output(batches[mine] if mine >= 0 else 0, pitch, dtype, seed % 2 == 1, rnd)
    # Two generations of output slots: the step's (the clock's OUT word plus one), and
    # decoys that must stay untouched; every requester has released the step before.
    last = rnd.randint(0, 5)
    decoys = [torch.full_like(o, -1.0) for o in outs]
    by_generation = torch.stack([out_addrs, torch.tensor([d.data_ptr() for d in decoys])])
    if (last + 1) % 2:
        by_generation = by_generation.flip(0).contiguous()
    free, err = torch.full((S,), max(last - 1, 0), dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    if mine >= 0:
        free[mine] = -1  # its own slot was not released: its rows do not go there
    clock_out = torch.tensor([last], dtype=torch.int64)
    k.rows_put.rows_put(
        src, headers[:, 1], own, mine, by_generation, cnt_addrs, free, err, clock_out, cap, pitch, col, 10**9
    )
    assert all((d == -1.0).all() for d in decoys), "only the step's generation is written"
    assert int(clock_out) == last and not err.any()
    for s, b in enumerate(batches):
        dest = own if s == mine else outs[s]
        assert torch.equal(dest[:b, col : col + dim], src[s * cap : s * cap + b]), s
        _assert_only_block_written(
            dest, b, slice(col, col + dim), counters[s], me, k.rows_put.programs_per_requester(b)
        )
        if s == mine:
            assert (outs[s] == -1.0).all(), "this rank's own slot is not written"
    outside_untouched()


@_interpreted
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradient_columns_land_in_their_owners_slots_divided_and_are_counted(k, seed, dtype):
    """``grads_put`` against torch's gradient division of each owner's columns: every owner gets
    its columns' rows, and only them, at the generation asked, and a count per program."""
    rnd = random.Random(seed)
    P = rnd.randint(1, 3)
    dims = [rnd.choice([4, 12, 128, 136, 260]) for _ in range(P)]  # past BLOCK_D too
    first = 4 * rnd.randint(0, 2)  # columns and the pitch: multiples of 4, as the kernel may assume
    cols = [first + sum(dims[:p]) for p in range(P)]
    pitch = first + sum(dims) + 4 * rnd.randint(0, 2)
    batch = rnd.choice([0, 1, 31, 32, 33, 70])
    cap = batch + rnd.choice([0, 1, 40])
    # (bf16 only by powers of two: the interpreter truncates fp32 to bf16, GPUs round.)
    world = rnd.choice([2, 4] if dtype == torch.bfloat16 else [2, 3, 4])
    grad = torch.randn(batch, pitch, generator=torch.Generator().manual_seed(seed)).to(dtype)
    owners, me = rnd.sample(range(4), P), rnd.randrange(4)
    per_generation = cap * max(dims)
    slots = [torch.full((2 * per_generation,), -1.0, dtype=dtype) for _ in range(P)]
    counters = [torch.zeros(4, dtype=torch.int64) for _ in range(P)]
    dests = torch.tensor(
        [
            [o, c, d, slot.data_ptr(), cnt.data_ptr() + 8 * me]
            for o, c, d, slot, cnt in zip(owners, cols, dims, slots, counters)
        ]
    )
    generation = rnd.randrange(2)
    step = 8 + generation  # of two generations: the owners released step 7 (step - 2 or later)
    released = torch.full((4,), 7, dtype=torch.int64)
    k.grads_put.grads_put(
        grad,
        dests,
        released,
        torch.zeros(4, dtype=torch.int64),
        cap,
        StepRef(torch.tensor([step - 1]), 1),  # as a clock's GRAD word gives it
        2,
        per_generation * grad.element_size(),
        float(torch.tensor(1.0) / world),
        10**9,
    )
    for p in range(P):
        # torch on CUDA divides by a scalar as a multiplication by its fp32 reciprocal
        # (on the CPU it divides).
        expected = (grad[:, cols[p] : cols[p] + dims[p]].float() * (torch.tensor(1.0) / world)).to(dtype)
        start = generation * per_generation
        got = slots[p][start : start + batch * dims[p]].view(batch, dims[p])
        assert torch.equal(got, expected), p
        untouched = slots[p].clone()
        untouched[start : start + batch * dims[p]] = -1.0
        assert (untouched == -1.0).all(), "nothing outside the source's rows is written"
        assert int(counters[p][me]) == k.grads_put.programs_per_source(cap)
        assert int(counters[p].sum()) == int(counters[p][me])


def _words(n: int):
    """``n`` int64 words standing in for peers' signal words, and their addresses."""
    words = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    return words, torch.tensor([w.data_ptr() for w in words], dtype=torch.int64)


@_interpreted
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fault", ["none", "bad_header", "timed_out"])
def test_output_is_taken_summed_in_rank_order_and_its_slots_released(k, seed, dtype, fault):
    """``output_take`` against torch's sum of the owners' blocks in rank order, two steps
    in a row: the step's generation of the slots taken (the clock's OUT word plus one),
    the slots released to every owner (and source) with the step, the clock advanced,
    the error record copied, the record written to the step's ring entry, and ``done``
    left at zero for the next launch. A step with a bad header or a timed-out wait has
    NaN outputs."""
    rnd = random.Random(seed)
    # (bf16 sums stay out: the interpreter truncates fp32 to bf16, GPUs round.)
    blocks = 1 if dtype == torch.bfloat16 else [1, 2, 3, 2, 1, 2][seed]
    pitch = 4 * rnd.randint(1, 70)  # past BLOCK_D too
    rows = rnd.choice([1, 40, 70])
    batch = 0 if seed == 4 else rnd.choice([1, max(rows // 2, 1), rows])
    slots = torch.randn(2, blocks, rows, pitch, generator=torch.Generator().manual_seed(seed)).to(dtype)
    world = 4
    owners = torch.tensor(sorted(rnd.sample(range(world), rnd.randint(1, world))), dtype=torch.int32)
    counts = torch.full((world,), 12, dtype=torch.int64)  # every owner's rows of both steps have arrived
    out_free, out_addrs = _words(owners.numel())
    ids_free, ids_addrs = _words(world)
    release_ids = rnd.random() < 0.5  # False: the lookup did not pool from the ids slots
    err = torch.tensor([int(fault == "timed_out"), 5, 6, 7], dtype=torch.int64)
    at = world * HEADER_WORDS
    record = torch.full((at + 5,), -1, dtype=torch.int64)
    record[:at:HEADER_WORDS] = Status.OK.value
    if fault == "bad_header":
        record[HEADER_WORDS * rnd.randrange(world)] = Status.ID_OUT_OF_RANGE.value
    record[at + 4] = 6  # the ids step
    last = rnd.randint(0, 5)
    clock = torch.zeros(8, dtype=torch.int64)
    clock[OUT], clock[EXPECTED] = last, 6
    ring = torch.zeros(4, at + 6, dtype=torch.int64)
    done = torch.zeros(1, dtype=torch.int64)
    # This rank's own rows, in ``out`` already: a block's columns (table-wise: some of
    # the one block's; row-wise: a whole block), or none (it owns no table).
    own_block = rnd.randrange(blocks)
    begin = 4 * rnd.randint(0, pitch // 4 - 1)
    end = rnd.choice([pitch, min(pitch, begin + 4 * rnd.randint(1, 40))])
    if blocks > 1:
        begin, end = 0, pitch
    if seed == 5:
        begin = end  # it owns no table
    mine = torch.randn(batch, pitch, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    for i in range(2):
        step = last + 1 + i
        # A column slice of the module's joined output in every other step.
        out, outside_untouched = _own_output(batch, pitch, dtype, (seed + i) % 2 == 1, rnd)
        out[:, begin:end] = mine[:, begin:end]
        k.output_take.output_take(
            slots,
            out,
            counts,
            owners,
            out_addrs,
            ids_addrs,
            done,
            err,
            record,
            at,
            clock,
            3,
            release_ids,
            ring,
            10**9,
            (own_block, begin, end),
        )
        assert int(done) == 0, "the last program leaves done at zero for the next launch"
        parts = slots[step % 2, :, :batch].clone()
        parts[own_block, :, begin:end] = mine[:, begin:end]
        expected = parts[0]
        for b in range(1, blocks):
            expected = expected + parts[b]
        if fault == "none":
            assert torch.equal(out, expected)
        else:
            assert out.isnan().all(), "a bad step's output is NaN, never a result"
        assert all(int(w) == step for w in out_free), "every owner gets its output slot back"
        assert all(int(w) == (6 if release_ids else 0) for w in ids_free), "and the sources their ids slots"
        assert clock[OUT] == step and clock[EXPECTED] == 6 + 3 * (i + 1), "the clock advances"
        assert record[at : at + 4].tolist() == err.tolist()
        assert ring[step % 4].tolist() == record.tolist() + [step], "the record goes to the step's ring entry"
        outside_untouched()


@_interpreted
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pooled_rows_land_at_their_final_place_and_are_counted(k, seed, dtype, monkeypatch):
    """``lookup_put`` against a sequential fp32 pooling of every bag: exact without
    per-sample weights, and to rounding with them (the interpreter has no fused
    multiply-add); twice, as two steps, so the row blocks are counted per step. Seed 4
    pins the sources' batches at the edges of a counted block of rows: none, exactly
    one block (the next block's programs return at once) and one row more."""
    # Programs count the earlier features' ids a few at a time too.
    monkeypatch.setattr(k.lookup_put, "MAX_FEATURES", [1, 1, 32, 2, 1][seed])
    g = torch.Generator().manual_seed(300 + seed)
    rnd = random.Random(seed)
    S, F = rnd.randint(1, 3), rnd.randint(1, 3)
    count_b = k.lookup_put.COUNT_B
    pinned = [0, count_b, count_b + 1] if seed == 4 else None
    S = len(pinned) if pinned else S
    weighted = seed % 2 == 1
    # Several blocks of counted rows, and outputs in the tables' dtype or in fp32.
    # Bags of several groups of ROWS ids, and empty ones.
    slots, layout, batches, sent = _owner_slots(
        g, rnd, S, F, weighted, max_batch=70, max_len=3 * k.lookup_put.ROWS + 1, batches=pinned
    )
    # (bf16 outputs stay out: the interpreter truncates fp32 to bf16, GPUs round to nearest.)
    out_dtype = dtype if seed < 2 and dtype != torch.bfloat16 else torch.float32
    cap = layout.batch_capacity
    dims = [rnd.choice([4, 12, 128, 136]) for _ in range(F)]  # past BLOCK_D too
    means = [rnd.random() < 0.5 for _ in range(F)]
    tables = [torch.randn(1000, d, generator=g).to(dtype) for d in dims]
    # Columns and the pitch are multiples of 4, as the kernel may assume.
    first_col = 4 * rnd.randint(0, 2)
    cols = [first_col + sum(dims[:f]) for f in range(F)]
    pitch = first_col + sum(dims) + 4 * rnd.randint(0, 2)
    features = torch.tensor([[t.data_ptr(), d, c, int(m)] for t, d, c, m in zip(tables, dims, cols, means)])
    # The ids step 1 (the clock's RECV word was 0) reads generation 1 of the mailbox;
    # the output step 1 (its OUT word is 0) stores at generation 1's addresses.
    mailbox = torch.full((2, slots.numel()), 0xA5, dtype=torch.uint8)
    mailbox[1] = slots
    record = torch.empty(S * HEADER_WORDS + 5, dtype=torch.int64)
    offsets = k.bag_offsets.bag_offsets(
        mailbox.view(-1),
        S,
        F,
        layout,
        record,
        k.bag_offsets.scan_state(F, S, layout, slots.device),
        torch.zeros(1, dtype=torch.int64),
    )
    outs, counters, me, out_addrs, cnt_addrs = _requesters(S, cap, pitch, out_dtype, rnd)
    # This rank's own rows go to its output instead of its slot (or no requester is).
    mine = rnd.randrange(-1, S)
    own, outside_untouched = _own_output(batches[mine] if mine >= 0 else 0, pitch, out_dtype, seed % 2 == 0, rnd)
    decoys = [torch.full_like(o, -1.0) for o in outs]
    by_generation = torch.stack([torch.tensor([d.data_ptr() for d in decoys]), out_addrs])
    done = k.lookup_put.done_counters(S, layout, slots.device)
    # The output step 3 (generation 1 again) waits for step 1's release of each slot,
    # but not of this rank's own, which it does not store into.
    free, err = torch.ones(S, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    if mine >= 0:
        free[mine] = 0
    for _ in range(2):
        k.lookup_put.lookup_put(
            mailbox.view(-1),
            record[S * HEADER_WORDS + 4 :],  # the ids step bag_offsets wrote
            torch.tensor([2], dtype=torch.int64),
            offsets,
            features,
            tables[0],
            own,
            mine,
            by_generation,
            cnt_addrs,
            done,
            free,
            err,
            layout,
            pitch,
            weighted,
            10**9,
        )
        assert not done.any(), "the last program of each block leaves it at zero for the next launch"
        assert not err.any(), "no wait timed out"
    assert all((d == -1.0).all() for d in decoys), "only the step's generation is written"
    for s, (lengths, ids, weights, ok) in enumerate(sent):
        b = batches[s]
        block = slice(first_col, first_col + sum(dims))
        dest = own if s == mine else outs[s]
        _assert_only_block_written(dest, b, block, counters[s], me, 2 * k.rows_put.programs_per_requester(b))
        if s == mine:
            assert (outs[s] == -1.0).all(), "this rank's own slot is not written"
        for f in range(F):
            start = int(lengths[:f].sum())
            for i in range(b):
                n = int(lengths[f, i]) if ok else 0
                acc = torch.zeros(dims[f])
                for j in range(start, start + n):
                    row = tables[f][ids[j]].float()
                    acc = acc + row * weights[j] if weighted else acc + row
                if means[f] and n:
                    acc = acc * (1.0 / torch.tensor(float(n)))
                got = dest[i, cols[f] : cols[f] + dims[f]]
                if weighted:
                    torch.testing.assert_close(got.float(), acc.to(out_dtype).float(), rtol=1e-2, atol=1e-3)
                else:
                    assert torch.equal(got, acc.to(out_dtype)), (s, f, i)
                start += int(lengths[f, i])
    outside_untouched()


def _fbgemm_cpu_tbe(optimizer: str, dims, table_of, mean: bool, wd_mode: int, seed: int):
    """FBGEMM's own table-batched module on the CPU (the oracle of ``row_update``)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
        WeightDecayMode,
    )

    rows = [7 + 5 * t for t in range(len(dims))]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in zip(rows, dims)],
        feature_table_map=table_of,
        optimizer=getattr(EmbOptimType, optimizer),
        learning_rate=0.05,
        eps=1e-2,
        weight_decay=0.03 if wd_mode else 0.0,
        weight_decay_mode=WeightDecayMode(wd_mode),
        pooling_mode=PoolingMode.MEAN if mean else PoolingMode.SUM,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tbe.weights_host.copy_(torch.randn(tbe.weights_host.shape, generator=g))
        if optimizer != "EXACT_SGD":
            tbe.momentum1_host.copy_(torch.rand(tbe.momentum1_host.shape, generator=g))
    return tbe, rows


def test_row_tables_skip_tables_without_rows():
    """``sort_order``'s tables of a lookup group: one per table with rows, by first row,
    whatever features share them; a table without rows shares its first row with the
    next table and holds no key."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from torchrec_pgas.sharding.fused_update import row_tables

    specs = [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in ((5, 8), (0, 8), (7, 4))]
    for optimizer, state in ((EmbOptimType.EXACT_ROWWISE_ADAGRAD, 5), (EmbOptimType.EXACT_SGD, 0)):
        tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, feature_table_map=[0, 1, 2, 0], optimizer=optimizer)
        # Table 2's rows follow table 0's 5 rows of 8 (40 weights) and 5 states.
        assert row_tables(tbe) == [[0, 0, 8, 0], [5, 40, 4, state]]
    none = SplitTableBatchedEmbeddingBagsCodegen(specs[1:2], optimizer=EmbOptimType.EXACT_SGD)
    assert row_tables(none) == [[0, 0, 0, 0]]


@_interpreted
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize(
    "optimizer,weighted,mean,wd_mode",
    [
        ("EXACT_SGD", False, False, 0),
        ("EXACT_SGD", True, False, 0),
        ("EXACT_ROWWISE_ADAGRAD", False, False, 0),
        ("EXACT_ROWWISE_ADAGRAD", True, False, 0),
        ("EXACT_ROWWISE_ADAGRAD", False, True, 0),
        ("EXACT_ROWWISE_ADAGRAD", True, False, 1),
        ("EXACT_ROWWISE_ADAGRAD", False, True, 2),
    ],
)
def test_row_update_matches_fbgemm_fused_backward(k, seed, wide, optimizer, weighted, mean, wd_mode, monkeypatch):
    """The fused sparse update of a padded, fixed-capacity index tensor equals a float64
    reference of FBGEMM's GPU update and, without weight decay (which FBGEMM's CPU
    kernel ignores), FBGEMM's fused backward of exactly the batch's ids (weights and
    optimizer state to 1e-6); with features sharing a table, repeated and skewed ids,
    empty bags; rows wide enough (``wide``) that a tile takes fewer positions; blocks of
    two (seed 0) or four positions in tiles of two (seed 1), so that most repeated rows
    cross blocks and ``run_update`` sums them a chunk of one or two blocks at a time (its
    programs checking one block or four), long runs covering groups of two blocks or of
    one that ``run_groups`` sums first, and
    ``update_keys`` takes four bags per program, two or four ids at a time; int64 keys and
    no padding (seed 2); the kernels' own shapes over many blocks and programs, a third
    of the capacity padding (seed 3). A bad step's record, or an error of the
    transport, leaves weights and optimizer state as they were, and the step's verdict is
    taken once: an error recorded after ``step_verdict`` does not split the update."""
    from torchrec_pgas.kernels import row_step
    from torchrec_pgas.sharding.fused_update import row_tables, sort_positions

    if seed < 2:
        monkeypatch.setattr(k.row_update, "TILE", 32)
        monkeypatch.setattr(k.row_update, "BLOCK", 2 * (seed + 1))
        # A program checks one block, or four (runs owned by several of its blocks).
        monkeypatch.setattr(k.run_update, "BLOCKS", 1 if seed == 0 else 4)
        # Groups of two blocks (long runs cover some, and begin and end inside them or
        # on their edges), or of one (every block after a run's first is a group's).
        monkeypatch.setattr(k.run_groups, "GROUP", 2 if seed == 0 else 1)
        # Both kernels add 2 (seed 0) or 1 (seed 1) partial sums at once.
        monkeypatch.setattr(k.run_groups, "TILE", 32 if seed == 0 else 16)
        # Keys of several programs' bags, each bag's ids a few at a time.
        monkeypatch.setattr(k.update_keys, "TILE", 8 * (seed + 1))
        monkeypatch.setattr(k.update_keys, "MIN_J", 2 * (seed + 1))
        monkeypatch.setattr(k.update_keys, "MAX_J", 2 * (seed + 1))
    dims = [260, 8, 36] if wide else [8, 16, 4]
    # FBGEMM's CPU row-wise Adagrad refuses features that share a table.
    table_of = [0, 1, 0, 2] if optimizer == "EXACT_SGD" else [0, 1, 2]
    tbe, rows = _fbgemm_cpu_tbe(optimizer, dims, table_of, mean, wd_mode, seed)
    # The hyper-parameters, read by the kernels from device memory: a learning rate per
    # seed, set as a schedule sets it.
    lr, eps, wd = [0.05, 0.3, 0.01, 0.07][seed], 1e-2, 0.03 if wd_mode else 0.0
    tbe.set_learning_rate(lr)
    g = torch.Generator().manual_seed(100 + seed)
    F, B = len(table_of), [5, 6, 7, 60][seed]
    lengths = torch.randint(0, 6, (F * B,), generator=g)
    lengths[torch.rand(F * B, generator=g) < 0.3] = 0
    per_feature = lengths.view(F, B).sum(1)
    # Skewed ids: a third of them the table's row 1.
    values = torch.cat([torch.randint(0, rows[table_of[f]], (int(per_feature[f]),), generator=g) for f in range(F)])
    values[torch.rand(values.numel(), generator=g) < 0.3] = 1
    offsets = _offsets(lengths)
    psw = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    # A gradient wider than the features' columns: the pitch is read, not assumed (and
    # for seed 1 not a multiple of 4, so its rows are not read 4 elements at a time).
    # Seeds 1 and 3 key the ids for rows of the columns alone, as the lookup output's
    # own gradient has them, and get a column slice of a wider one (as ``torch.cat``'s
    # backward gives a module's sharding): read at its rows' stride.
    total_dim = sum(dims[t] for t in table_of)
    grad = torch.randn(B, total_dim + (3 if seed == 1 else 4), generator=g)[:, :total_dim]
    pitch = total_dim if seed in (1, 3) else grad.stride(0)

    adagrad = optimizer != "EXACT_SGD"
    w0 = tbe.weights_host.detach().clone()
    m0 = tbe.momentum1_host.detach().clone() if adagrad else torch.empty(0)
    # Ours first, on copies, with the index tensor padded past the batch's ids.
    pad = [9, 4, 0, 200][seed]
    indices = torch.cat([values, torch.randint(-5, 1000, (pad,), generator=g)])
    psw_in = torch.cat([psw, torch.rand(pad, generator=g)]) if weighted else torch.empty(1)
    D_off = tbe.D_offsets.tolist()
    first_row = tbe.hash_size_cumsum.tolist()
    state_at = tbe.momentum1_offsets.tolist() if adagrad else [0] * F
    features = torch.tensor([[first_row[f], D_off[f], int(mean)] for f in range(F)], dtype=torch.int64)
    tables = torch.tensor(row_tables(tbe), dtype=torch.int64)
    n = indices.numel()
    key_dtype = torch.int64 if seed == 2 else k.update_keys.key_dtype(int(tbe.total_hash_size))
    scaled = weighted or mean
    S = 3
    no_error = torch.zeros(4, dtype=torch.int64)

    def run(record, err=no_error, err_after_verdict=None):
        keys = torch.empty(n, dtype=key_dtype)
        src = torch.empty(n, dtype=torch.int64)
        scale = torch.empty(n) if scaled else torch.empty(1)
        verdict = torch.empty(1, dtype=torch.int64)
        err = err.clone()
        total_rows = int(tbe.total_hash_size)
        packed = k.update_keys.packs(key_dtype, B, pitch)
        assert packed == (seed != 2)
        k.update_keys.update_keys(
            offsets, indices, psw_in, features, keys, src, scale, B, pitch, total_rows, scaled, weighted, packed
        )  # fmt: skip
        k.step_verdict.step_verdict(record, err, verdict, S)
        if err_after_verdict is not None:
            err.copy_(err_after_verdict)
        order = sort_positions(keys, total_rows)
        # In the sort's order as ``FusedUpdate.prepare`` puts them, poisoned past the ids:
        # the update must read nothing there.
        sorted_keys = torch.empty_like(keys)
        sorted_src = torch.full_like(src, -(2**40))
        sorted_table = torch.full((n,), -(2**30), dtype=torch.int32)
        sorted_scale = torch.full_like(scale, float("nan"))
        k.sort_order.sort_order(
            keys, order, total_rows, offsets, src, scale, tables, sorted_keys, sorted_src, sorted_scale, sorted_table,
            scaled, packed,
        )  # fmt: skip
        src, scale = sorted_src, sorted_scale if scaled else scale
        partial = torch.full(k.row_update.partial_shape(n, max(dims)), float("nan"))
        table, state = w0.clone(), m0.clone() if m0.numel() else torch.empty(1)
        optim = row_step.SGD if optimizer == "EXACT_SGD" else row_step.ROWWISE_ADAGRAD
        rule = row_step.StepRule(optim, wd_mode)
        hyper = torch.tensor([lr, eps, wd])
        k.row_update.row_update(
            sorted_keys, src, scale, sorted_table, tables, grad, pitch, table, state, partial, verdict, hyper,
            max(dims), rule, scaled,
        )  # fmt: skip
        sums = torch.full(k.run_groups.sums_shape(n, max(dims)), float("nan"))
        k.run_groups.run_groups(sorted_keys, partial, sums, max(dims))
        k.run_update.run_update(
            sorted_keys, sorted_table, tables, table, state, partial, sums, verdict, hyper, max(dims), rule
        )
        return table, state

    ok_record = torch.zeros(S * HEADER_WORDS + 4, dtype=torch.int64)
    ok_record[: S * HEADER_WORDS : HEADER_WORDS] = int(Status.OK)
    table, state = run(ok_record)
    bad_record = ok_record.clone()
    bad_record[HEADER_WORDS] = int(Status.ID_OUT_OF_RANGE)
    timed_out = torch.tensor([1, 0, 0, 0], dtype=torch.int64)  # a wait of the backward timed out
    for untouched in (
        run(bad_record),
        run(ok_record, timed_out),
        run(ok_record, timed_out, err_after_verdict=no_error),
    ):
        assert torch.equal(untouched[0], w0) and (not adagrad or torch.equal(untouched[1], m0))
    late = run(ok_record, err_after_verdict=timed_out)  # recorded by another stream's wait, meanwhile
    assert torch.equal(late[0], table) and (not adagrad or torch.equal(late[1], state))

    # The float64 reference: per row, the batch-order sum of its occurrences' gradients.
    ref_w, ref_m = w0.double().clone(), m0.double().clone()
    summed = {}
    for f in range(F):
        dim, col = D_off[f + 1] - D_off[f], D_off[f]
        for b in range(B):
            lo, hi = int(offsets[f * B + b]), int(offsets[f * B + b + 1])
            for p in range(lo, hi):
                scale = (float(psw[p]) if weighted else 1.0) / ((hi - lo) if mean else 1)
                key = int(tbe.weights_offsets[f]) + int(values[p]) * dim
                row = grad[b, col : col + dim].double() * scale
                summed[key] = (summed[key][0] + row, f) if key in summed else (row, f)
    for key, (gsum, f) in summed.items():
        dim = D_off[f + 1] - D_off[f]
        w = ref_w[key : key + dim]
        if not adagrad:
            w -= lr * gsum
            continue
        g2 = gsum + wd * w if wd_mode == 1 else gsum
        at = state_at[f] + (key - int(tbe.weights_offsets[f])) // dim
        ref_m[at] += (g2 * g2).mean()
        mult = lr / (ref_m[at].sqrt() + eps)
        c = 1 - mult * wd if wd_mode == 1 else 1 - lr * wd if wd_mode == 2 else 1.0
        w.copy_(c * w - mult * gsum)
    assert not torch.equal(ref_w.float(), w0)
    torch.testing.assert_close(table, ref_w.float(), rtol=1e-6, atol=1e-6)
    if adagrad:
        torch.testing.assert_close(state, ref_m.float(), rtol=1e-6, atol=1e-6)
    if wd_mode == 0:
        tbe(values, offsets, per_sample_weights=psw).backward(grad)
        torch.testing.assert_close(table, tbe.weights_host.detach(), rtol=1e-6, atol=1e-6)
        if adagrad:
            torch.testing.assert_close(state, tbe.momentum1_host.detach(), rtol=1e-6, atol=1e-6)


def _as_on_gpu(tbe):
    """``tbe`` (FBGEMM's CPU module) with its weights and row-wise state where a GPU
    module keeps them (``weights_dev``, ``momentum1_dev``), which is what the fused
    update reads."""
    with torch.no_grad():
        tbe.weights_dev = torch.nn.Parameter(tbe.weights_host.detach().clone())
        tbe.weights_host = torch.nn.Parameter(torch.empty(0))
        if tbe.optimizer.name == "EXACT_ROWWISE_ADAGRAD":
            tbe.momentum1_dev = torch.nn.Parameter(tbe.momentum1_host.detach().clone(), requires_grad=False)
            tbe.momentum1_host = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    return tbe


@_interpreted
def test_update_keys_refuses_words_that_do_not_pack(k):
    """``packed`` where ``packs`` says no (int64 keys) is an error, not truncated words;
    gradient rows past 2**31 do not pack either."""
    with pytest.raises(ValueError, match="do not pack"):
        k.update_keys.update_keys(*[torch.zeros(2, dtype=torch.int64)] * 3, torch.zeros(1, 3, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.zeros(2), 1, 4, 2**40,
            False, False, True)  # fmt: skip
    assert not k.update_keys.packs(torch.int32, 2**16, 2**15), "gradient rows past 2**31 do not pack"


@_interpreted
# Only int32 keys pack (test_update_keys_refuses_words_that_do_not_pack).
@pytest.mark.parametrize("key_dtype,packed", [(torch.int32, False), (torch.int32, True), (torch.int64, False)])
@pytest.mark.parametrize("weighted,mean", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("tile", [(8, 16), (32, 4)])
def test_update_keys_of_long_and_empty_bags(k, weighted, mean, key_dtype, tile, packed, monkeypatch):
    """``update_keys`` against a Python reference, position by position: bags of 0 to 70
    ids over several programs (8 bags each, 16 ids at a time; or 32 bags, 4 ids at a time,
    as a tile shaped for one-hot features takes them), two features sharing a table, a
    padded capacity past the ids (the group's row count as their key; with int64 keys, a
    count past int32's and offsets that start past 0 too), where nothing but the key is
    written; ``packed`` (int32 keys only), each gradient row times 2**32 plus the key."""
    block_b, block_j = tile
    monkeypatch.setattr(k.update_keys, "TILE", block_b * block_j)
    monkeypatch.setattr(k.update_keys, "MIN_J", block_j)
    monkeypatch.setattr(k.update_keys, "MAX_J", block_j)
    g = torch.Generator().manual_seed(7 + weighted + 2 * mean)
    F, B, pitch = 3, 11, 40
    # Per feature: first row, column, mean (features 0 and 2 share a table).
    features = torch.tensor([[0, 0, int(mean)], [100, 8, int(mean)], [0, 24, int(mean)]], dtype=torch.int64)
    lengths = torch.randint(0, 71, (F * B,), generator=g)
    lengths[torch.rand(F * B, generator=g) < 0.3] = 0
    offsets = _offsets(lengths) + (5 if key_dtype == torch.int64 else 0)
    first_id, total, n = int(offsets[0]), int(offsets[-1]), int(offsets[-1]) + 29
    indices = torch.randint(0, 100, (n,), generator=g)
    weights = torch.rand(n, generator=g) + 0.5
    keys = torch.full((n,), -7, dtype=key_dtype)
    src = torch.full((n,), -7, dtype=torch.int64)
    scale = torch.full((n,), float("nan"))
    scaled = weighted or mean
    rows = 200 if key_dtype == torch.int32 else 2**40
    assert k.update_keys.packs(key_dtype, B, pitch) == (key_dtype == torch.int32)
    k.update_keys.update_keys(
        offsets, indices, weights if weighted else torch.empty(1), features, keys, src, scale, B, pitch, rows,
        scaled, weighted, packed,
    )  # fmt: skip
    no_id = torch.cat([torch.arange(first_id), torch.arange(total, n)])
    assert bool((keys[no_id] == rows).all())
    assert bool((src[no_id] == -7).all() and scale[no_id].isnan().all())
    for bag in range(F * B):
        f, row = divmod(bag, B)
        first, col, _ = features[f].tolist()
        lo, hi = int(offsets[bag]), int(offsets[bag + 1])
        for p in range(lo, hi):
            i = int(indices[p])
            word = ((row * pitch + col) << 32) + first + i if packed else row * pitch + col
            assert (int(keys[p]), int(src[p])) == (first + i, word), (bag, p)
            if scaled:
                expected = float(weights[p]) if weighted else float(torch.tensor(1.0) / (hi - lo))
                assert float(scale[p]) == expected, (bag, p)


def test_update_keys_tile_follows_ids_per_bag(k):
    """One-hot groups take many bags per program, long bags a tile's worth of ids at a
    time; a group without bags, and one of a thousand ids per bag, stay in bounds."""
    uk = k.update_keys
    assert uk.tile_shape(3 * 65536, 65536) == (uk.TILE // uk.MIN_J, uk.MIN_J)
    assert uk.tile_shape(6 * 1000, 1000) == (uk.TILE // 8, 8)
    assert uk.tile_shape(100 * 1000, 1000) == (uk.TILE // uk.MAX_J, uk.MAX_J)
    assert uk.tile_shape(0, 0) == (uk.TILE // uk.MIN_J, uk.MIN_J)
    assert uk.tile_shape(100000, 1) == (uk.TILE // uk.MAX_J, uk.MAX_J)


def _unfilled_sorted_ids(n: int, scaled: bool) -> Tuple[torch.Tensor, ...]:
    """The four arrays a sort of the update fills (keys, gradient rows, scales and
    tables of ``n`` sorted positions), holding values no kernel writes; a one-element
    placeholder for the scales if not ``scaled``."""
    return (
        torch.full((n,), -1, dtype=torch.int32),
        torch.full((n,), -1, dtype=torch.int64),
        torch.full((n,), float("nan")) if scaled else torch.empty(1),
        torch.full((n,), -1, dtype=torch.int32),
    )


@_interpreted
@pytest.mark.parametrize("scaled", [False, True])
def test_packed_words_sort_as_the_keys_and_gradient_rows_they_hold(k, scaled):
    """``update_keys`` then ``sort_order`` as ``FusedUpdate.prepare`` runs them, with and
    without packing: the same sorted keys, gradient rows, scales and tables, for
    offsets that start past 0 (positions before them and past the ids keyed ``rows``)
    and gradient rows up to the packing bound (2**31 - 1)."""
    from torchrec_pgas.sharding.fused_update import sort_positions

    g = torch.Generator().manual_seed(11 + scaled)
    F, B, rows = 3, 7, 160
    pitch = (2**31 - 1) // B
    assert k.update_keys.packs(torch.int32, B, pitch) and not k.update_keys.packs(torch.int32, B, pitch + 1)
    # Per feature: its table's first row, its column (the last ends at the pitch), mean.
    features = torch.tensor([[0, 0, int(scaled)], [50, pitch - 12, 0], [100, pitch // 2, int(scaled)]])
    tables = torch.tensor([[0, 0, 4, 0], [50, 200, 8, 50], [100, 600, 4, 100]])
    lengths = torch.randint(0, 6, (F * B,), generator=g)
    offsets = _offsets(lengths) + 6
    n = int(offsets[-1]) + 9
    indices = torch.randint(0, 50, (n,), generator=g)
    weights = torch.rand(n, generator=g)
    outs = []
    for packed in (False, True):
        keys, src = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int64)
        scale = torch.empty(n) if scaled else torch.empty(1)
        k.update_keys.update_keys(
            offsets, indices, weights, features, keys, src, scale, B, pitch, rows, scaled, False, packed
        )  # fmt: skip
        order = sort_positions(keys, rows)
        out = _unfilled_sorted_ids(n, scaled)
        k.sort_order.sort_order(keys, order, rows, offsets, src, scale, tables, *out, scaled, packed)
        outs.append(out)
    ids = int(offsets[-1] - offsets[0])
    (keys_out, src_out, scale_out, table_out), packed = outs
    assert torch.equal(keys_out, packed[0]) and torch.equal(src_out, packed[1]) and torch.equal(table_out, packed[3])
    if scaled:
        assert torch.equal(scale_out[:ids], packed[2][:ids]) and bool(packed[2][ids:].isnan().all())
    assert torch.equal(keys_out[:ids], torch.sort(keys_out[:ids])[0]) and bool((keys_out[ids:] == 2**31 - 1).all())
    assert int(src_out[:ids].max()) > 2**31 - pitch, "gradient rows near the bound unpack as they were"


#: What FBGEMM's ``transpose_embedding_input`` leaves in a position no bag covers.
_UNKEYED = -7


def _transpose_embedding_input(hash_size_cumsum, total_bits, indices, offsets, nobag, vbe, b_bits, b_mask):
    """FBGEMM's ``transpose_embedding_input`` (CUDA only) as its source reads, for the
    arguments ``fused_update.transpose_sort`` gives it: each id of bag ``b`` of feature
    ``t`` keyed ``hash_size_cumsum[t] + id`` with the value ``t << b_bits | b`` (bags
    feature-major, as many per feature), then a stable sort over the keys' low
    ``total_bits`` bits. Positions no bag covers keep what their memory held
    (``_UNKEYED`` here)."""
    assert not nobag and vbe is None and b_mask == (1 << b_bits) - 1
    # FBGEMM reads ``hash_size_cumsum`` as int64 whatever the ids' dtype (and checks it).
    assert hash_size_cumsum.dtype == torch.int64 and indices.dtype == offsets.dtype == torch.int32
    T = hash_size_cumsum.numel() - 1
    B = (offsets.numel() - 1) // T
    assert B * T == offsets.numel() - 1
    keys = torch.full_like(indices, _UNKEYED)
    infos = torch.full_like(indices, _UNKEYED)
    for bag in range(T * B):
        t, b = divmod(bag, B)
        lo, hi = int(offsets[bag]), int(offsets[bag + 1])
        keys[lo:hi] = hash_size_cumsum[t] + indices[lo:hi]
        infos[lo:hi] = (t << b_bits) | b
    order = torch.sort(keys.long() & ((1 << total_bits) - 1), stable=True)[1]
    return keys, keys[order], infos[order], None, None, None, None


@_interpreted
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transpose_bags_covers_every_position(k, seed, monkeypatch):
    """``transpose_bags`` copies the offsets and adds a feature whose bags cover the
    positions past the ids, spread over its bags (none holds more than its share,
    rounded up), with id 0 there; so FBGEMM's op keys every position: the ids by their
    rows, the rest by the group's row count. Over blocks (of 16 here), empty bags, no
    padding at all (seed 2), and more padding than bags."""
    monkeypatch.setattr(k.transpose_bags, "BLOCK", 16)
    g = torch.Generator().manual_seed(seed)
    F, B = 3, 5 + seed
    lengths = torch.randint(0, 4, (F * B,), generator=g)
    lengths[torch.rand(F * B, generator=g) < 0.3] = 0
    offsets = _offsets(lengths)
    ids = int(offsets[-1])
    n = ids + [37, 3, 0][seed]
    indices = torch.cat([torch.randint(0, 9, (ids,), generator=g), torch.full((n - ids,), -5)]).to(torch.int32)
    original = indices.clone()
    out = torch.full((offsets.numel() + B,), -1, dtype=torch.int32)
    k.transpose_bags.transpose_bags(offsets, indices, out, B)
    assert torch.equal(out[: offsets.numel()].long(), offsets)
    ends = out[offsets.numel() :].long()
    sizes = torch.diff(torch.cat([offsets[-1:], ends]))
    assert int(ends[-1]) == n and bool((sizes >= 0).all())
    assert int(sizes.max()) <= -(-(n - ids) // B)
    assert torch.equal(indices[:ids], original[:ids]) and bool((indices[ids:] == 0).all())
    first_rows = torch.tensor([0, 9, 18, 27, 27])  # the extra feature's: 27 rows
    keys, *_ = _transpose_embedding_input(first_rows, 5, indices, out, False, None, 3, 7)
    assert bool((keys[ids:] == 27).all()) and bool((keys[:ids] < 27).all())


@_interpreted
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("scaled", [False, True])
def test_transposed_ids_equal_the_other_sort(k, seed, scaled, monkeypatch):
    """``update_keys``, ``sort_positions`` and ``sort_order`` on one side, and on the
    other ``transpose_bags``, FBGEMM's op (``_transpose_embedding_input``) and
    ``transposed_ids``: the same keys, gradient rows, scales (mean pooling on some
    features) and tables at every sorted position of the ids, the sentinel past them.
    Features sharing a table, a table without rows, empty bags, hot rows, blocks of 16
    with a partial last one, and gradient rows in a wider gradient (pitch)."""
    from torchrec_pgas.sharding.fused_update import sort_positions, transpose_info_bits

    monkeypatch.setattr(k.transpose_bags, "BLOCK", 16)
    monkeypatch.setattr(k.transposed_ids, "BLOCK", 16)
    g = torch.Generator().manual_seed(seed)
    B, pitch = 4 + seed, 40
    # Features 0 and 2 read table 0 (10 rows), 1 table 1 (empty: its bags are), 3 table 2 (6 rows).
    first_rows, table_rows = [0, 10, 0, 10], [10, 0, 10, 6]
    rows = 16
    features = torch.tensor([[r, 8 * f, int(scaled and f % 2 == 0)] for f, r in enumerate(first_rows)])
    tables = torch.tensor([[0, 0, 8, 0], [10, 80, 4, 10]])
    F = len(first_rows)
    lengths = torch.randint(0, 5, (F * B,), generator=g)
    lengths[torch.rand(F * B, generator=g) < 0.3] = 0
    lengths[B : 2 * B] = 0
    offsets = _offsets(lengths)
    ids = int(offsets[-1])
    n = ids + 11
    values = torch.cat(
        [
            torch.randint(0, max(table_rows[f], 1), (int(lengths[f * B : (f + 1) * B].sum()),), generator=g)
            for f in range(F)
        ]
    )
    values[torch.rand(ids, generator=g) < 0.3] = 1
    indices = torch.cat([values, torch.randint(-3, 3, (n - ids,), generator=g)])
    keys, src = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int64)
    scale = torch.empty(n) if scaled else torch.empty(1)
    k.update_keys.update_keys(offsets, indices, scale, features, keys, src, scale, B, pitch, rows, scaled, False, False)
    order = sort_positions(keys, rows)
    expected = _unfilled_sorted_ids(n, scaled)
    k.sort_order.sort_order(keys, order, rows, offsets, src, scale, tables, *expected, scaled, False)

    bits = transpose_info_bits(F, B)
    ids32 = indices.to(torch.int32)
    out_offsets = torch.empty(offsets.numel() + B, dtype=torch.int32)
    k.transpose_bags.transpose_bags(offsets, ids32, out_offsets, B)
    hash_size_cumsum = torch.tensor(first_rows + [rows, rows])
    _, sorted_keys, infos, *_ = _transpose_embedding_input(
        hash_size_cumsum, rows.bit_length(), ids32, out_offsets, False, None, bits, (1 << bits) - 1
    )
    got = _unfilled_sorted_ids(n, scaled)
    k.transposed_ids.transposed_ids(
        sorted_keys, infos, out_offsets, features, tables, *got, rows, B, pitch, bits, scaled
    )  # fmt: skip
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    assert bool((got[0][ids:] == 2**31 - 1).all())
    assert torch.equal(got[1][:ids], expected[1][:ids]) and torch.equal(got[3][:ids], expected[3][:ids])
    if scaled:
        assert torch.equal(got[2][:ids], expected[2][:ids])
        assert bool((got[2][:ids] < 1).any()), "some bag of a mean-pooled feature holds several ids"


def test_transpose_info_bits_refuses_what_int32_infos_cannot_hold():
    from torchrec_pgas.sharding.fused_update import transpose_info_bits

    assert transpose_info_bits(3, 1) == 1 and transpose_info_bits(3, 8) == 3 and transpose_info_bits(3, 9) == 4
    assert transpose_info_bits(2**14 - 2, 2**17) == 17
    assert transpose_info_bits(2**14 - 1, 2**17) is None


def test_update_ids_are_int32_where_every_group_keys_by_int32():
    from types import SimpleNamespace

    from torchrec_pgas.sharding.fused_update import FusedUpdate

    update = FusedUpdate(enabled=True, weighted=False, device=torch.device("cpu"))
    small, large = SimpleNamespace(keys=torch.int32), SimpleNamespace(keys=torch.int64)
    assert update.ids_dtype([small, small]) == torch.int32
    assert update.ids_dtype([small, large]) == torch.int64


@triton.jit
def _row_places(tables, table_index, keys, out, TABLE_WORDS: tl.constexpr):
    """Each position's ``row_place`` (weights offset, dim, state index), as a row of ``out``."""
    p = tl.program_id(0)
    at, dim, state_at = row_place(tables, tl.load(table_index + p), tl.load(keys + p), True, TABLE_WORDS)
    tl.store(out + p * 3, at)
    tl.store(out + p * 3 + 1, dim)
    tl.store(out + p * 3 + 2, state_at)


@_interpreted
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("n", [1, 3, 5, 37, 64])
@pytest.mark.parametrize("key_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("packed", [False, True])
def test_sort_order_equals_indexing(k, n, scaled, key_dtype, packed, monkeypatch):
    """``sort_order`` puts the keys and the per-position arrays in a stable sort's order
    (``sort_positions``' int32 one, or for int64 keys and even ``n`` ``torch.sort``'s
    int64 one), as
    torch's indexing does, and writes each sorted position's table from its key (the
    last table whose first row is at most the key, of ``1 + n % 5`` tables; with the key,
    it gives the row's place, ``row_place``), over blocks (of 16 here) with a partial
    last one; positions past the ids (key ``rows``, about a third here, sorted last) get
    the sentinel key and nothing else; the scale is left alone unless ``scaled``.
    ``packed`` (int32 keys): the keys and gradient rows come from the packed words alone
    (the key array and the words past the ids are poison), the ids counted by the
    offsets."""
    if packed and key_dtype != torch.int32:
        pytest.skip("only int32 keys pack")
    from torchrec_pgas.sharding.fused_update import sort_positions

    monkeypatch.setattr(k.sort_order, "BLOCK", 16)
    g = torch.Generator().manual_seed(n)
    # Per table with rows: first row, weights offset, dim, state offset.
    rows = torch.randint(1, 9, (1 + n % 5,), generator=g)
    first = torch.cumsum(rows, 0) - rows + (3 if key_dtype == torch.int64 else 0)
    dims = 4 * torch.randint(1, 5, (rows.numel(),), generator=g)
    tables = torch.stack([first, torch.randint(0, 2**30, rows.shape, generator=g), dims, 100 * first + 7], 1)
    total = int(first[-1] + rows[-1])
    table = torch.randint(0, rows.numel(), (n,), generator=g)
    keys = (first[table] + (torch.rand(n, generator=g) * rows[table]).long()).to(key_dtype)
    keys[torch.rand(n, generator=g) < 0.3] = total
    if key_dtype == torch.int32 or n % 2:
        order = sort_positions(keys, total)
        assert order.dtype == torch.int32 and torch.equal(order.long(), torch.sort(keys, stable=True)[1])
    else:
        order = torch.sort(keys, stable=True)[1]
    ids = int((keys != total).sum())
    src = torch.randint(0, 2**31, (n,), generator=g) if packed else torch.randint(-(2**40), 2**40, (n,), generator=g)
    scale = torch.rand(n, generator=g)
    keys_out, src_out = torch.full_like(keys, -1), torch.full_like(src, -1)
    table_out, scale_out = torch.full((n,), -1, dtype=torch.int32), torch.full((n,), float("nan"))
    # Offsets that start past 0 (bag sizes do not matter here, only the ids' count).
    offsets = torch.tensor([5, 5 + ids // 2, 5 + ids])
    words = torch.where(keys != total, (src << 32) | keys.long(), -(2**62))
    k.sort_order.sort_order(
        torch.full_like(keys, -3) if packed else keys, order, total, offsets, words if packed else src, scale, tables,
        keys_out, src_out, scale_out, table_out, scaled, packed,
    )  # fmt: skip
    expected = keys[order.long()]
    assert torch.equal(keys_out[:ids], expected[:ids])
    assert bool((keys_out[ids:] == k.update_keys.sentinel(key_dtype)).all())
    assert torch.equal(src_out[:ids], src[order.long()][:ids])
    firsts = tables[:, 0].tolist()
    places = torch.full((max(ids, 1), 3), -1, dtype=torch.int64)
    if ids:
        _row_places[(ids,)](tables, table_out, keys_out, places, TABLE_WORDS=k.sort_order.TABLE_WORDS)
    for p in range(ids):
        key = int(keys_out[p])
        assert int(table_out[p]) == max(t for t, first in enumerate(firsts) if first <= key), p
        # The row's place the update finds from the table and the key (``row_place``).
        base, w_at, dim, s_at = max((row for row in tables.tolist() if row[0] <= key), key=lambda row: row[0])
        assert places[p].tolist() == [w_at + (key - base) * dim, dim, s_at + key - base], p
    assert bool((src_out[ids:] == -1).all() and (table_out[ids:] == -1).all())
    if scaled:
        assert torch.equal(scale_out[:ids], scale[order.long()][:ids]) and bool(scale_out[ids:].isnan().all())
    else:
        assert bool(scale_out.isnan().all())


@_interpreted
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("transposed", [False, True])
def test_fused_update_of_several_groups_matches_fbgemm(k, seed, transposed, monkeypatch):
    """``FusedUpdate`` as the owner runs it: two lookup groups (``EXACT_SGD`` over two
    tables, ``EXACT_ROWWISE_ADAGRAD`` over one) read their columns of one gradient
    (the second group's after the first's; with seed 1 a column slice of a wider one,
    as a module with several sharding types gives each), from index tensors of fixed
    capacity padded past the batch's ids; each group's tables equal FBGEMM's backward of exactly the
    batch's ids (1e-6) over three steps whose learning rate changes (through the fused
    optimizer, through FBGEMM's module), and a bad step's record updates neither.
    The ids are int32, as ``ids_dtype`` gives them; ``transposed``: they take
    ``transpose_sort`` (as on GPUs), FBGEMM's op emulated by
    ``_transpose_embedding_input``."""
    import copy
    from types import SimpleNamespace

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_pgas.sharding.fused_update import FusedUpdate

    specs = [("EXACT_SGD", [8, 16], [0, 1]), ("EXACT_ROWWISE_ADAGRAD", [4], [0])]
    refs = [
        _fbgemm_cpu_tbe(opt, dims, table_of, False, 0, seed + i)[0] for i, (opt, dims, table_of) in enumerate(specs)
    ]
    g = torch.Generator().manual_seed(40 + seed)
    B, S = 6, 2
    batches = []
    for ref in refs:
        F = len(ref.D_offsets) - 1
        lengths = torch.randint(0, 5, (F * B,), generator=g)
        lengths[torch.rand(F * B, generator=g) < 0.3] = 0
        rows = [ref.embedding_specs[t][0] for t in ref.feature_table_map]
        values = torch.cat(
            [torch.randint(0, rows[f], (int(lengths[f * B : (f + 1) * B].sum()),), generator=g) for f in range(F)]
        )
        values[torch.rand(values.numel(), generator=g) < 0.3] = 1  # a hot row per table
        padded = torch.cat([values, torch.randint(0, 3, (7,), generator=g)])
        batches.append((values, _offsets(lengths), padded))
    widths = [int(ref.D_offsets[-1]) for ref in refs]
    grad = torch.randn(B, sum(widths), generator=g)
    # Seed 1: the gradient as ``torch.cat``'s backward hands it to one sharding of a
    # module, a column slice of a wider one, which the update reads where it is.
    given = grad
    if seed == 1:
        wide = torch.randn(B, sum(widths) + 12, generator=g)
        wide[:, 8 : 8 + sum(widths)] = grad
        given = wide[:, 8 : 8 + sum(widths)]
    ours = [_as_on_gpu(copy.deepcopy(ref)) for ref in refs]
    # Each lookup's fused optimizer, as far as the update reads it.
    optimizers = [SimpleNamespace(param_groups=[{"lr": ref.get_learning_rate()}]) for ref in refs]
    lookups = [SimpleNamespace(emb_module=t, fused_optimizer=o) for t, o in zip(ours, optimizers)]
    update = FusedUpdate(enabled=True, weighted=False, device=torch.device("cpu"))
    groups = update.groups(lookups)
    assert groups is not None and update.groups(lookups) is groups
    assert all(group.transposed is None for group in groups), "FBGEMM's op runs on GPUs only"
    if transposed:
        monkeypatch.setattr(torch.ops.fbgemm, "transpose_embedding_input", _transpose_embedding_input)
        for group in groups:
            group.transposed = torch.tensor(group.tbe.hash_size_cumsum.tolist() + [group.rows])
    ids_dtype = update.ids_dtype(groups)
    assert ids_dtype == torch.int32
    kjts = [
        KeyedJaggedTensor(
            keys=[f"f{f}" for f in range(len(o) - 1)],
            values=padded.to(ids_dtype),
            offsets=o,
        )
        for (_, o, padded) in batches
    ]
    record = torch.zeros(S * HEADER_WORDS + 4, dtype=torch.int64)
    record[: S * HEADER_WORDS : HEADER_WORDS] = int(Status.OK)
    err = torch.zeros(4, dtype=torch.int64)
    bad = record.clone()
    bad[0] = int(Status.OVER_CAPACITY)
    before = [t.weights_dev.clone() for t in ours]
    prepared = update.prepare(groups, kjts, B, grad.shape[1])
    update.apply(groups, prepared, given, grad.shape[1], bad, err, S)
    assert all(torch.equal(t.weights_dev, w) for t, w in zip(ours, before))
    # Good steps at the tables' learning rate; at one a schedule set in the fused
    # optimizers' param_groups, taken by ``refresh`` (as before a graph's replay); at one
    # set in FBGEMM's modules, read by the update itself (as after an eager step's
    # ``optimizer.step()``).
    for step, lr in enumerate((None, 0.4, 0.03)):
        if step == 1:
            for o in optimizers:
                o.param_groups[0]["lr"] = lr
            update.refresh()
        elif step == 2:
            for t in ours:
                t.set_learning_rate(lr)
        update.apply(groups, prepared, given, grad.shape[1], record, err, S)
        col = 0
        for ref, mine, (values, offsets, _), width, w0 in zip(refs, ours, batches, widths, before):
            if lr is not None:
                ref.set_learning_rate(lr)
            ref(values, offsets).backward(grad[:, col : col + width])
            col += width
            assert not torch.equal(mine.weights_dev, w0)
            torch.testing.assert_close(mine.weights_dev, ref.weights_host.detach(), rtol=1e-6, atol=1e-6)
            if ref.optimizer.name == "EXACT_ROWWISE_ADAGRAD":
                torch.testing.assert_close(mine.momentum1_dev, ref.momentum1_host.detach(), rtol=1e-6, atol=1e-6)


@triton.jit
def _self_copy(addrs, size: tl.int64, COPY: tl.constexpr):
    """``copy_bytes`` from ``addrs[1]`` to ``addrs[0]``."""
    copy_bytes(tl.load(addrs), tl.load(addrs + 1), size, COPY)


@_interpreted
@pytest.mark.parametrize("seed", [0, 1])
def test_self_copy_of_put_signal_at_every_alignment(seed):
    """``put_signal``'s copy to the rank itself (``copy_bytes``) equals torch's copy for
    sources and destinations at byte offsets 0 to 16 and sizes that are multiples of
    16, 8, 4 or 1 (each word path), across tiles (of 256 bytes here) and a tail, and
    writes nothing around its destination."""
    g = torch.Generator().manual_seed(seed)
    for case in range(30):
        unit = [1, 4, 8, 16][case % 4]
        size = int(torch.randint(0, 1500, (1,), generator=g)) // unit * unit
        at_src, at_dst = [0, 1, 4, 8, 16][case % 5], [0, 2, 4, 8, 16][(case // 5) % 5]
        src = torch.randint(0, 256, (size + 32,), generator=g, dtype=torch.uint8)
        dst = torch.zeros(size + 32, dtype=torch.uint8)
        _self_copy[(1,)](torch.tensor([dst.data_ptr() + at_dst, src.data_ptr() + at_src]), size, COPY=256)
        expected = torch.zeros(size + 32, dtype=torch.uint8)
        expected[at_dst : at_dst + size] = src[at_src : at_src + size]
        assert torch.equal(dst, expected), (case, size, at_src, at_dst)


@triton.jit
def _shares(out, num_rows: tl.int64, self_row: tl.int64, PROGRAMS: tl.constexpr, SPLIT: tl.constexpr):
    """Each program's ``program_share``, as a row of ``out``."""
    pid = tl.program_id(0)
    p, j, parts, part = program_share(pid, num_rows, self_row, PROGRAMS, SPLIT)
    row = out + pid * 4
    tl.store(row, p)
    tl.store(row + 1, j)
    tl.store(row + 2, part * 0 + parts)
    tl.store(row + 3, part)


@_interpreted
@pytest.mark.parametrize("split", [1, 3, 16])
def test_put_signal_programs_cover_every_part_of_every_row_once(split):
    """Over ``put_signal``'s grid, every row's parts are moved by exactly one program
    each: ``PROGRAMS`` parts for a peer's row, ``PROGRAMS * split`` for the self row
    (given), whose share ``j`` (the one count its last program adds) has exactly
    ``split`` programs, the parts ``j * split ...``; rows in any position of the
    peers, from 1 to 8 rows."""
    programs = 4
    for rows in range(1, 9):
        for self_row in range(rows) if split > 1 else [-1, 0, rows - 1]:
            n = grid_size(rows, programs, split)
            out = torch.full((n, 4), -7, dtype=torch.int64)
            _shares[(n,)](out, rows, self_row, PROGRAMS=programs, SPLIT=split)
            seen = {}
            for p, j, parts, part in out.tolist():
                seen.setdefault(p, []).append((j, parts, part))
            assert sorted(seen) == list(range(rows)), (rows, self_row)
            for p, got in seen.items():
                wide = split > 1 and p == self_row
                parts = programs * split if wide else programs
                assert sorted(part for _, _, part in got) == list(range(parts)), (rows, self_row, p)
                assert all(n_parts == parts for _, n_parts, _ in got)
                assert all(j == (part // split if wide else part) for j, _, part in got)
