"""The GPU exchange's reading of a failed rank's message, on CPU tensors: the slots of a
step are given back at the receive, so a later send may overwrite a message while it is
read; only a text read between two identical headers counts."""

import torch

from torchrec_pgas.kernels.ids_slot import MIN_IDS_CAPACITY, Capacity, Header, IdsSlotLayout, Status
from torchrec_pgas.sharding import device_batch
from torchrec_pgas.sharding.device_batch import failure_texts


def _step(layout, message, seed):
    """Two sources' slots of one step: source 0 sent a batch, source 1 its failure."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, 256, (2, layout.nbytes), dtype=torch.uint8, generator=g)
    text = layout.encode_text(message)
    sent = [Header(Status.OK, 3, 5, False, ()), Header(Status.FAILED, 0, 0, False, (text.numel(),))]
    for slot, header in zip(slots, sent):
        slot[: layout.lengths_offset].view(torch.int64)[:] = header.encode()
    slots[1, layout.lengths_offset : layout.lengths_offset + text.numel()] = text
    return slots, [layout.header(slot) for slot in slots]


def test_a_failed_slot_gives_its_message_and_a_good_one_none():
    layout = IdsSlotLayout.for_batch(3, 4, 64, Capacity(1.0))
    for seed, message in enumerate(["rank 1 could not send its batch: RuntimeError: boom", "é ü"]):
        slots, headers = _step(layout, message, seed)
        assert failure_texts(headers, slots.view(-1), layout) == ["", message]


def test_a_message_overwritten_while_read_is_not_shown(monkeypatch):
    layout = IdsSlotLayout.for_batch(3, 4, 64, Capacity(1.0))
    slots, headers = _step(layout, "rank 1 could not send its batch: RuntimeError: boom", 0)
    read = IdsSlotLayout.text

    def text_then_next_send(self, slot, nbytes):
        out = read(self, slot, nbytes)
        # The source's next send lands in the slot between the two header reads.
        slot[: layout.lengths_offset].view(torch.int64)[:] = Header(Status.OK, 2, 2, False, ()).encode()
        return out

    monkeypatch.setattr(IdsSlotLayout, "text", text_then_next_send)
    assert failure_texts(headers, slots.view(-1), layout) == ["", device_batch._OVERWRITTEN]


def test_a_message_overwritten_before_it_is_read_is_not_shown():
    layout = IdsSlotLayout.for_batch(3, 4, 64, Capacity(1.0))
    slots, headers = _step(layout, "rank 1 could not send its batch: RuntimeError: boom", 1)
    slots[1, : layout.lengths_offset].view(torch.int64)[:] = Header(Status.OK, 2, 2, False, ()).encode()
    assert failure_texts(headers, slots.view(-1), layout) == ["", device_batch._OVERWRITTEN]


def _gather_oracle(ids, step, world, offsets, indices, weights, first, size, layout, weighted):
    """``gather_ids`` on CPU: the group's ids of every bag, in bag order (here from
    ``ids``, the step's ids laid out as the slots' would be gathered), and weights."""
    bags = world * layout.batch_capacity
    lo, hi = int(offsets[first * bags]), int(offsets[(first + size) * bags])
    indices[: hi - lo] = ids[lo:hi]
    if weighted:
        weights[: hi - lo] = ids[lo:hi].float() / 2


def test_lookup_groups_as_tensors_hold_the_kjts_ids_in_each_streams_own_tensors(monkeypatch):
    """``LookupGroups.tensors`` (the quantized module's groups) gives each group's ids,
    offsets and weights as ``kjts`` does, in index tensors of the slots' capacity that
    are the stream's own, the same at every step; unweighted groups have no weights."""
    from torchrec_pgas.sharding.tw_base import TwFeature

    monkeypatch.setattr(device_batch, "gather_ids", _gather_oracle)
    world, features = 2, [TwFeature(f"f{i}", f"t{i}", 100) for i in range(3)]
    layout = IdsSlotLayout.for_batch(3, 4, 64, Capacity(1.0))
    bags = world * layout.batch_capacity
    g = torch.Generator().manual_seed(3)
    for weighted in (False, True):
        groups = device_batch.LookupGroups(features, [2, 1], weighted, False, layout, world, torch.device("cpu"))
        seen = {}
        for step in range(3):
            lengths = torch.randint(0, 3, (3 * bags,), generator=g)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            ids = torch.randint(0, 100, (int(offsets[-1]),), generator=g)
            kjts = groups.kjts(ids, torch.tensor([step]), offsets, exact=False)
            for stream in (1, 2):
                tensors = groups.tensors(ids, torch.tensor([step]), offsets, stream)
                assert len(tensors) == len(kjts) == 2
                for kjt, group in zip(kjts, tensors):
                    n = int(kjt.offsets()[-1])
                    assert group.values().numel() == kjt.values().numel() == world * layout.ids_capacity
                    assert torch.equal(group.values()[:n], kjt.values()[:n])
                    assert torch.equal(group.offsets(), kjt.offsets())
                    assert (group.weights_or_none() is None) == (kjt.weights_or_none() is None) == (not weighted)
                    if weighted:
                        assert torch.equal(group.weights()[:n], kjt.weights()[:n])
                ptrs = [group.values().data_ptr() for group in tensors]
                assert seen.setdefault(stream, ptrs) == ptrs, "the stream's own tensors at every step"
        assert set(seen[1]).isdisjoint(seen[2]), "each stream has its own"


def test_a_streams_send_scratch_is_its_own_and_its_put_counters_start_at_zero():
    """A send's scratch (``StreamScratch.send``): the same for every send of a stream,
    another stream's apart (two streams' sends may overlap), the share counters of
    ``put_signal``'s split copy to the rank itself zero, one per share."""
    from torchrec_pgas.kernels.put_signal import PROGRAMS_PER_PEER

    layout = IdsSlotLayout.for_batch(3, 4, 64, Capacity(1.0))
    scratch = device_batch.StreamScratch(torch.zeros(2, 1, 3, dtype=torch.int64), 3, layout, 2, torch.device("cpu"))
    a, b = scratch.send(1), scratch.send(2)
    assert scratch.send(1) is a
    for field in a._fields:
        assert getattr(a, field).data_ptr() != getattr(b, field).data_ptr(), field
    assert a.put_done.shape == (PROGRAMS_PER_PEER,) and a.put_done.dtype == torch.int64
    assert not a.put_done.any() and not b.put_done.any()


def test_the_narrowed_lengths_of_a_stream_are_its_own_tensor():
    """A send's narrowed lengths (``StreamScratch.narrowed``): the stream's tensor,
    the same for every batch that fits the capacity, another stream's apart; a batch
    over capacity gets its own, and the stream's keeps its address (a graph may hold it)."""
    layout = IdsSlotLayout.for_batch(3, 4, 64, Capacity(1.0))
    runs = torch.zeros(2, 1, 3, dtype=torch.int64)
    scratch = device_batch.StreamScratch(runs, 3, layout, 2, torch.device("cpu"), input_features=3)
    a = scratch.narrowed(7, 12)
    assert a.shape == (12,) and a.dtype == torch.int32
    assert scratch.narrowed(7, 12) is a
    b = scratch.narrowed(7, 3 * layout.batch_capacity)
    assert b.data_ptr() == a.data_ptr(), "a batch within capacity: the same tensor"
    assert scratch.narrowed(8, 12).data_ptr() != a.data_ptr(), "another stream"
    big = scratch.narrowed(7, 3 * layout.batch_capacity + 1)  # over capacity (its step raises)
    assert big.numel() == 3 * layout.batch_capacity + 1
    assert scratch.narrowed(7, 12).data_ptr() == a.data_ptr(), "the stream's tensor kept its address"


def test_a_known_largest_batch_sizes_the_slots_for_it():
    """``max_batch_size`` gives the slots that many samples and ``headroom`` times the
    first batch's ids per sample for each; below ``headroom`` times the first batch, or
    with no first batch, it changes nothing but the samples."""
    layout = IdsSlotLayout.for_batch(3, 100, 1000, Capacity(2.0, max_batch=1000))
    assert (layout.batch_capacity, layout.ids_capacity) == (1000, 20000)
    # The largest batch (100 samples, 1 id each) and id count (10 samples of 100 ids)
    # were two ranks': the largest ratio of one rank's sizes is given.
    layout = IdsSlotLayout.for_batch(3, 100, 1000, Capacity(2.0, max_batch=1000), ids_per_sample=100)
    assert (layout.batch_capacity, layout.ids_capacity) == (1000, 200000)
    assert IdsSlotLayout.for_batch(3, 100, 1000, Capacity(2.0, max_batch=150)) == IdsSlotLayout.for_batch(
        3, 100, 1000, Capacity(2.0)
    )
    layout = IdsSlotLayout.for_batch(3, 0, 0, Capacity(2.0, max_batch=300))
    assert (layout.batch_capacity, layout.ids_capacity) == (300, MIN_IDS_CAPACITY)


def test_an_over_capacity_message_names_the_limit_passed_and_its_setting():
    from torchrec_pgas.kernels.ids_slot import describe

    layout = IdsSlotLayout.for_batch(3, 4, 64, Capacity(1.0))  # the least: 128 samples, 8192 ids
    samples = describe(1, Header(Status.OVER_CAPACITY, 200, 0, False, (200, 10, 0)), [], layout)
    assert "the slots take 128 samples" in samples and "max_batch_size" in samples
    ids = describe(0, Header(Status.OVER_CAPACITY, 100, 0, False, (100, 9000, 0)), [], layout)
    assert "the slots take 8192 ids" in ids and "raise headroom" in ids and "samples (" not in ids
