"""Errors raised between steps, never in the middle of one.

On GPU ranks an inference step's problems are read from its record after the step
(``sharding/step_records.py``) and raised by a later call (``Exchange.raise_errors``),
which may come one step earlier on one rank than on another. The sharded module asks
every exchange before the step's first send, so a rank that raises has sent nothing of
that step: its peers wait for its next batch, and nothing is paired with the wrong
step. These tests make one exchange of one rank report an error at a chosen call (the
host exchanges have none of their own to report) and check that, and the ring's
bookkeeping, on real processes.
"""

from typing import List

import pytest
import torch
from dist_utils import assert_close_to_reference, make_tables, random_kjt, reference_pooled, run_ranks, shard
from torchrec import EmbeddingBagCollection

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding.step_records import StepRecords
from torchrec_pgas.sharding.tw_base import PgasInputError
from torchrec_pgas.sharding_plan import pgas_row_wise, pgas_table_wise
from torchrec_pgas.transport import PgasError
from torchrec_pgas.types import PgasOptions


def _reports_once(exchange, at_call: int, message: str) -> None:
    """Makes ``exchange.raise_errors`` raise ``PgasInputError(message)`` at its
    ``at_call``-th call."""
    calls: List[None] = []
    original = exchange.raise_errors

    def raise_errors(wait: bool = False) -> None:
        calls.append(None)
        if len(calls) == at_call:
            raise PgasInputError(message)
        original(wait)

    exchange.raise_errors = raise_errors


def _raised_before_the_step(rank, world_size):
    tables = make_tables(3, seed=5)
    torch.manual_seed(5)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    placement = {
        tables[0].name: pgas_table_wise(rank=0),
        tables[1].name: pgas_row_wise(),
        tables[2].name: pgas_table_wise(rank=world_size - 1),
    }
    sharder = PgasEmbeddingBagCollectionSharder(options=PgasOptions(timeout_s=30))
    model = shard(ref, placement, world_size, sharder)
    ebc = model.module.ebc
    with torch.no_grad():
        model(random_kjt(tables, 4, rank)).to_dict()  # the first batch sets the exchanges up
        exchanges = [s.exchange for s in ebc._embedding_shardings]
        assert ebc._pgas_direct is True and len(exchanges) == 2
        # The last rank's row-wise exchange reports an error at the module's third
        # step after this: on that rank only, as when its device finished a bad step
        # sooner than its peers'.
        if rank == world_size - 1:
            _reports_once(exchanges[1], 3, "a bad batch two steps ago")
        served = 0
        # The rank that raised skipped a batch: it takes one more, as a serving loop
        # goes on to its next request.
        for step in range(6 if rank < world_size - 1 else 7):
            kjt = random_kjt(tables, 3 + rank + step, 100 * step + rank)
            sent = [x.sent_steps for x in exchanges]
            try:
                out = model(kjt).to_dict()
            except PgasInputError as e:
                assert rank == world_size - 1 and step == 2 and "a bad batch two steps ago" in str(e)
                assert [x.sent_steps for x in exchanges] == sent, "nothing of the step was sent"
                continue
            served += 1
            assert_close_to_reference(out, reference_pooled(tables, ref.state_dict(), kjt, row_wise=(tables[1].name,)))
        assert served == 6


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_error_raised_between_steps_on_one_rank_leaves_every_step_right(world_size):
    run_ranks(_raised_before_the_step, world_size, deadline_s=300)


def _ring(words: int, entries: int = 4) -> StepRecords:
    return StepRecords(words, torch.device("cpu"), entries=entries)


def _write(records: StepRecords, step: int, value: int) -> None:
    entry = records.ring[step % records.ring.size(0)]
    entry[:-1] = value
    entry[-1] = step


def test_records_are_read_in_order_as_far_as_the_device_wrote_them():
    records = _ring(3)
    _write(records, 1, 10)
    _write(records, 2, 20)
    _write(records, 4, 40)  # step 3 not yet written: 4 waits behind it
    got = records.finished(4, wait=False)
    assert [(r.step, r.words) for r in got] == [(1, [10] * 3), (2, [20] * 3)]
    assert records.checked == 2
    assert records.finished(4, wait=False) == []
    _write(records, 3, 30)
    assert [r.step for r in records.finished(4, wait=False)] == [3, 4]
    assert records.finished(4, wait=False) == [] and records.checked == 4


def test_an_entry_the_device_never_wrote_is_named_when_waited_for():
    records = _ring(2)
    _write(records, 1, 1)
    with pytest.raises(PgasError, match="record of output step 2 never came"):
        records.finished(2, wait=True)
    assert records.checked == 1, "what was read stays read"


def test_room_is_made_by_reading_the_entry_a_step_reuses():
    records = _ring(2, entries=4)
    for step in range(1, 5):
        _write(records, step, step)
    assert records.make_room(4) == [], "step 4 reuses no unread entry"
    got = records.make_room(6)  # reuses the entries of steps 2 (and before: 1)
    assert [r.step for r in got] == [1, 2] and records.checked == 2
    # An entry overwritten by a later step is not taken for the earlier one.
    _write(records, 7, 7)  # the entry of step 3
    with pytest.raises(PgasError, match="record of output step 3 never came"):
        records.finished(3, wait=True)
