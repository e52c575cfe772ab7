"""The set-up and lifetime of ``DeviceTwExchange`` (``tw_device_exchange.py``): what
its constructor takes, and what the first send allocates (collectively, sized from the
largest first batch of any rank): the symmetric ``DeviceBuffers``, the peers' address
tables (``PeerTables``: peer mappings, or the put path's tables), the send's and
receive's scratch, and the lookup groups; and the host's one check of a step's
record. The step itself reads in ``tw_device_exchange.py``.
"""

import collections
from typing import Any, Deque, List, Optional, Sequence, Tuple

import torch

from torchrec_pgas.kernels import grads_put, rows_put
from torchrec_pgas.kernels.ids_header import feature_runs
from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Header, IdsSlotLayout, Status
from torchrec_pgas.kernels.lookup_put import done_counters
from torchrec_pgas.kernels.output_take import RECORD_WORDS
from torchrec_pgas.kernels.step_clock import OUT, RECORD_STEP, RECV, SEND, StepRef
from torchrec_pgas.sharding.device_batch import DeviceRoute, FusedTables, LookupGroups, StreamScratch, failure_texts
from torchrec_pgas.sharding.device_routing import (
    IdsRouting,
    OutputBlocks,
    PeerTables,
    TableWiseIds,
    first_batch_sizes,
)
from torchrec_pgas.sharding.exchange import raise_together
from torchrec_pgas.sharding.fused_update import FusedUpdate
from torchrec_pgas.sharding.step_records import Record, StepRecords
from torchrec_pgas.sharding.tw_base import BaseTwExchange
from torchrec_pgas.transport.base import PgasError
from torchrec_pgas.transport.device_buffers import BufferSizes, DeviceBuffers
from torchrec_pgas.transport.nvshmem import NvshmemTransport

#: The most samples per source a GPU slot takes: ``rows_put`` and ``grads_put`` launch a
#: program per ``BLOCK_B`` samples on a grid axis that CUDA caps at 65535 programs.
MAX_BATCH_CAPACITY = 65535 * min(rows_put.BLOCK_B, grads_put.BLOCK_B)


class DeviceTwSetup(BaseTwExchange):
    """``DeviceTwExchange`` less its step. Arguments: those of ``BaseTwExchange``,
    plus the number of features of each lookup group of this rank (``group_sizes``, in
    lookup order), whether the plan's tables are weighted, whether the lookup reads
    only the bags' ids (else it gets exactly the batch's ids), whether inference may
    pool with ``lookup_put`` (every group FBGEMM ``FUSED``, sum or mean pooling, no
    feature processor), whether a training step may update those tables itself
    (``fused_update.py``; ``PgasOptions.sparse_update``), which owner gets which ids (``routing``, default
    ``TableWiseIds``), where owners store pooled rows (``output``, default one
    block, each owner at its columns) and whether the owner's lookup takes its groups
    as ``GroupIds`` rather than KJTs, on the receive's stream before the next receive
    there (``group_tensors``: an owner that calls FBGEMM itself, the quantized
    module). Its ``DeviceBuffers`` come at the first send (``_allocate``,
    collective); ``close`` frees them."""

    def __init__(
        self,
        transport: NvshmemTransport,
        group_sizes: Sequence[int],
        weighted: bool,
        lookup_reads_only_bags: bool,
        fused_lookup: bool,
        fused_update: bool = False,
        routing: Optional[IdsRouting] = None,
        output: Optional[OutputBlocks] = None,
        group_tensors: bool = False,
        **plan: Any,
    ) -> None:
        super().__init__(transport, **plan)
        self._t: NvshmemTransport = transport
        self._dev = transport.device
        self._me = transport.rank
        self._counts = [len(f) for f in self._features_per_rank]
        self._routing: IdsRouting = routing if routing is not None else TableWiseIds(self._counts)
        self._output = out = (
            output if output is not None else OutputBlocks(1, 0, self._dim_total, tuple(self._col_offsets))
        )
        # This rank's own rows go straight into its output (``own_rank``: the put kernels'
        # requester for that; ``own_columns``: ``output_take``'s block and columns of it)
        # where its columns are 4-element aligned, as the kernels' masks assume; else
        # (a dense table of odd dim) through its slot, as any owner's.
        begin, end = out.col_offsets[self._me], out.col_offsets[self._me] + self._dims[self._me]
        aligned = begin % 4 == 0 and end % 4 == 0
        self._own_rank = self._me if aligned else -1
        self._own_columns = (out.my_block, begin, end) if aligned else (out.my_block, 0, 0)
        self._group_sizes = list(group_sizes)
        self._weighted = weighted
        self._exact_always = not lookup_reads_only_bags
        self._group_tensors = group_tensors
        self._owners = torch.tensor(self._owners_with_tables, dtype=torch.int32, device=self._dev)
        self._fused = FusedTables(fused_lookup, self._output.col_offsets[self._me], self._dev)
        self._update = FusedUpdate(fused_lookup and fused_update, weighted, self._dev)
        self._update_agreed: Optional[bool] = None  # every rank's tables qualify (first training step)
        # Per step sent: the batch size its header reported, and the rows of its output.
        self._my_batches: Deque[Tuple[int, int]] = collections.deque()
        self._buffers: Optional[DeviceBuffers] = None
        self._text: Optional[torch.Tensor] = None  # the message a failing send puts
        # A step's record (``DeviceRoute.record``): every source's header, then the
        # error record from this word on, then the ids step.
        self._err_at = transport.world_size * HEADER_WORDS
        self._errors = StepRecords(self._err_at + RECORD_WORDS, self._dev)
        self._pending: List[PgasError] = []  # what finished steps reported, not raised yet

    def _allocate(self, batch_size: int, offsets: torch.Tensor) -> None:
        """Sizes the buffers from the largest first batch of any rank (collective)."""
        t, world, me = self._t, self._t.world_size, self._me
        t.reclaim()  # the buffers of models gone since the last allocation
        routed = [self._routing.routed_features(w, self._input_pos) for w in range(world)]
        self._runs = feature_runs(routed, self._dev)
        batch, ids, per_sample = first_batch_sizes(batch_size, offsets, routed, t.group, self._dev)
        self._layout = layout = IdsSlotLayout.for_batch(max(self._counts), batch, ids, self._capacity, per_sample)
        if layout.batch_capacity > MAX_BATCH_CAPACITY:  # the same on every rank: sizes were all-reduced
            raise ValueError(
                f"{self._name}: slots of {layout.batch_capacity} samples per source (the first batch's "
                f"{batch} times PgasOptions.headroom, or max_batch_size) are more than the GPU exchange's "
                f"kernels take ({MAX_BATCH_CAPACITY}): lower headroom or max_batch_size, or split the batch"
            )
        out = self._output
        sizes = BufferSizes(
            layout.nbytes, out.blocks, layout.batch_capacity, out.dim, max(self._dims), self._dims[me], self._out_dtype
        )
        self._buffers = buffers = DeviceBuffers(t, sizes)
        buffers.free_when_collected(self)  # the model may go without closing us
        # The clock's words the step's launches are given (views made once: each view
        # is a host step).
        self._clock_send = buffers.clock[SEND : SEND + 1]
        self._sent_step = StepRef(self._clock_send)
        self._clock_recv = buffers.clock[RECV : RECV + 1]
        self._clock_out = buffers.clock[OUT : OUT + 1]
        self._peers = PeerTables(buffers, out, self._owners_with_tables, self._dims, me, self._elem)
        # Every generation's table: the kernels pick the step's on the device.
        self._out_addrs = torch.stack(self._peers.out_addrs)
        self._done = done_counters(world, layout, self._dev)
        features = self._features_per_rank[me]
        self._scratch = StreamScratch(self._runs, len(features), layout, world, self._dev, len(self._input_features))
        self._groups = LookupGroups(
            features, self._group_sizes, self._weighted, self._exact_always, layout, world, self._dev
        )
        # The lookup output of a step whose rows ``lookup_put`` put (none); in training,
        # a stand-in of the lookup output's shape, which only carries its gradient.
        self._no_rows = torch.empty(0, self._dims[me], dtype=self._out_dtype, device=self._dev)
        self._all_rows = torch.zeros(1, dtype=self._out_dtype, device=self._dev).expand(
            world * layout.batch_capacity, self._dims[me]
        )
        self._take_done = torch.zeros(1, dtype=torch.int64, device=self._dev)
        # torch divides by a scalar as a multiplication by its fp32 reciprocal.
        self._grad_scale = float(torch.tensor(1.0) / world)
        torch.cuda.synchronize(self._dev)
        t.barrier()

    def _check(self, route: DeviceRoute) -> None:
        """Raises what the step's headers or the device-side waits report, now (one
        sync). Every rank raises here for this step alike; what earlier steps reported
        is kept for the next ``raise_errors``."""
        self._keep(self._errors.finished(self._out_step - 1, wait=True))
        self._errors.checked = self._out_step
        self._read_record(Record(self._out_step, route.record.tolist()))

    def _keep(self, records: Sequence[Record]) -> None:
        """Keeps what ``records`` report, to be raised by ``raise_errors``."""
        for record in records:
            try:
                self._read_record(record)
            except PgasError as e:
                self._pending.append(e)

    def _read_record(self, record: Record) -> None:
        """Raises what a step's record reports."""
        words, n = record.words, HEADER_WORDS
        err = words[self._err_at : self._err_at + 4]
        if err[0]:  # the error record's code word
            raise self._t.timeout_error(err, self._name)
        if not any(words[0 : self._err_at : n]):  # every source's status is OK (0)
            self._failure_cause = None  # as ``_raise_for_bad_headers`` leaves it
            return
        headers = [Header.decode(words[n * s : n * s + n]) for s in range(self._t.world_size)]
        # The ids step, as the host exchange names it: output steps skip dropped ones.
        step = words[self._err_at + RECORD_STEP]
        texts: Sequence[str] = ()
        if any(h.status == Status.FAILED for h in headers):
            assert self._buffers is not None and self._layout is not None
            texts = failure_texts(headers, self._buffers.slots(step), self._layout)
        self._raise_for_bad_headers(headers, step, texts)

    def raise_errors(self, wait: bool = False) -> None:
        """See ``Exchange.raise_errors``: what the records of finished steps report,
        the first error with the others as notes (each is raised once)."""
        self._keep(self._errors.finished(self._out_step, wait))
        pending, self._pending = self._pending, []
        raise_together(pending)

    def step_counters(self) -> Tuple[int, ...]:
        """See ``Exchange.step_counters``."""
        return (self._send_step, self._recv_step, self._out_step, self._grad_step)

    def advance(self, delta: Sequence[int]) -> None:
        """See ``Exchange.advance``: the device keeps the true counts (its clock); the
        host's follow them, so that later eager steps and the error check agree."""
        self._send_step += delta[0]
        self._recv_step += delta[1]
        self._out_step += delta[2]
        self._grad_step += delta[3]
        self._errors.checked = min(self._errors.checked, self._out_step)

    def before_replay(self) -> None:
        """See ``Exchange.before_replay``: the fused update's hyper-parameters."""
        self._update.refresh()

    def close(self) -> None:
        """Frees the exchange's symmetric memory (collective: every rank closes at the
        same point); the exchange cannot be used after. Safe to call twice."""
        if self._buffers is not None:
            self._buffers.close()
