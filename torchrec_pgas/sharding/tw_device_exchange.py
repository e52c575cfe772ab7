"""The table-wise algorithm on GPUs: NVSHMEM puts and signals from Triton kernels.

The steps are those of ``tw_exchange`` (read it first); what differs is that no size
crosses to the host on the inference path. Every size a kernel needs (ids per owner,
batch sizes of the sources, bag offsets) is computed on the device and read by the
kernels, so the host only enqueues a handful of launches per step:

* ``send_ids``: ``ids_check`` validates every id and length, ``ids_header`` writes the
  slot headers and each owner's byte ranges, and ``put_signal`` puts them into every
  owner's slot with many blocks per owner, counting them in with the owner's ready
  signal. A batch with bad ids is sent as its header alone, so owners never index out
  of bounds.
* ``recv_ids``: one launch (``bag_offsets``) waits for every source's slot, keeps the
  step's headers and lays the lookup batch out with a fixed number of bags: bag
  ``(f, s, b)`` for every source ``s`` and ``b < batch_capacity``, bags past a
  source's batch size empty; ``gather_ids`` copies the ids into place. For FBGEMM's
  backward the index tensor must hold exactly the batch's ids (it sorts all of it),
  which costs one read-back; otherwise it has the slots' capacity and FBGEMM reads only
  what the offsets cover (its bounds check is off: sources have checked every id).
* ``lookup_put`` (FBGEMM ``FUSED`` tables): the receive leaves the groups empty and
  keeps the slots held; the lookup pools every requester's bags straight from them and
  stores the rows into the requesters' output slots, as ``rows_put`` would. In
  training it also keys and sorts the step's ids for the fused update of the backward
  (``fused_update.py``), which every rank takes or none does (``_agreed_updates``).
* ``exchange_pooled``: ``rows_put`` stores each requester's rows straight into its
  output slot (peer mapping) and counts them in (or ``lookup_put`` did), the rank's
  own rows straight into its output; the requester's ``output_take`` waits for its
  count, copies the other owners' rows out of the slot (NaN for a bad step), releases
  the slot (and the ids slots ``lookup_put`` pooled from) and copies the step's record
  into the ring in pinned host memory (``step_records.py``): nothing is read back, and
  what a step reports is raised before a later step's first send (``raise_errors``).
  With FBGEMM's backward the step is checked before its output is returned (one
  read-back).
* ``exchange_grads``: ``grads_put`` stores each owner's columns of the output gradient
  (divided as TorchRec divides them) straight into the owner's per-source slot; the
  owner's slots of a step are the gradient, in lookup order, that the fused update (or
  FBGEMM's backward, whose fused optimizer then updates exactly as under
  ``table_wise``) reads without a copy. The slots have one generation (read in place,
  at one address, which a CUDA graph needs): the owner releases them at its next
  backward, before that step's puts. At world size 1 with the fused update the one
  slot would hold a copy of the output's gradient: the update reads that instead.

Peers without a peer mapping (other nodes; every peer with
``PgasOptions(remote_path="put")``) are served by the same launches compiled with
``put_path``: rows and gradients go through local symmetric staging and NVSHMEM puts,
counts and releases through NVSHMEM signals (``PeerTables``). Ids and the slots'
releases always travel by ``put_signal``, on either path: NVSHMEM puts to peers, a plain
copy to the rank itself.

The class below reads in that order; its constructor, the allocation at the first
send, the host's check of a step's record and ``close`` are its base's
(``DeviceTwSetup``, ``tw_device_setup.py``). Its symmetric memory is one
``DeviceBuffers`` (``transport/device_buffers.py``: every buffer's shape, the waits
and releases, and ``close``); the lookup batch and the step's route are in
``device_batch.py``; what row-wise changes (routing, output blocks) is given to the
constructor (``device_routing.py``).
"""

import functools
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from triton.runtime.driver import driver

from torchrec_pgas.kernels import step_clock
from torchrec_pgas.kernels.bag_offsets import bag_offsets
from torchrec_pgas.kernels.grads_put import grads_put, programs_per_source
from torchrec_pgas.kernels.ids_check import ids_check
from torchrec_pgas.kernels.ids_header import ids_header
from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, Status
from torchrec_pgas.kernels.launch import strided_rows
from torchrec_pgas.kernels.lookup_put import lookup_put
from torchrec_pgas.kernels.output_take import RECORD_WORDS, output_take
from torchrec_pgas.kernels.put_signal import put_signal
from torchrec_pgas.kernels.rows_put import programs_per_requester, rows_put
from torchrec_pgas.kernels.step_clock import GRAD, RECORD_STEP, StepRef
from torchrec_pgas.sharding.device_batch import (
    DeviceRoute,
    LookupBatch,
    SlotsLookup,
    put_text,
    send_input,
)
from torchrec_pgas.sharding.device_routing import MAX_RUNS
from torchrec_pgas.sharding.exchange import OutputSpec, check_dest
from torchrec_pgas.sharding.fused_update import GroupUpdate, PendingUpdate
from torchrec_pgas.sharding.tw_device_setup import DeviceTwSetup
from torchrec_pgas.transport import PgasError
from torchrec_pgas.transport.device_buffers import GRAD_DEPTH
from torchrec_pgas.transport.mailbox import DEFAULT_DEPTH

__all__ = ["MAX_RUNS", "DeviceTwExchange"]


class DeviceTwExchange(DeviceTwSetup):
    """GPU counterpart of ``TwExchange``: the step, read top to bottom. Its arguments,
    the allocation at the first send, ``_check`` and ``close`` are ``DeviceTwSetup``'s."""

    # ------------------------------------------------------------------- send

    def _send(self, kjt: KeyedJaggedTensor) -> int:
        """Puts this rank's ids for the next step into every owner's slot; returns the
        step. What may fail on this rank alone comes before the step is counted."""
        self._t.check_alive(self._name)
        stream = driver.active.get_current_stream(self._dev.index)
        # The stream's narrowed lengths, once the scratch is there (after the first send).
        narrowed = functools.partial(self._scratch.narrowed, stream) if self._layout is not None else None
        x = send_input(kjt, self._host_problem(kjt), self._weighted, self._routing, self._dev, narrowed)
        if self._layout is None:
            self._allocate_once(x.batch, x.offsets)
        buffers, layout = self._buffers, self._layout
        assert buffers is not None and layout is not None
        # A pipeline may send the next batch before this one's lookup; only a send that
        # reuses the held slots' generation means the lookup is not coming.
        if buffers.held is not None and self._send_step + 1 - buffers.held >= DEFAULT_DEPTH:
            buffers.release_held()
        self._make_room()
        verdict, headers, chunks, put_done = self._scratch.send(stream)
        text = None
        if x.problem is not None and x.problem[0] == Status.FAILED:
            text = self._failure_text(layout).to(self._dev)
            x = x._replace(problem=(Status.FAILED, (text.numel(),)))
        self._send_step += 1
        step = self._send_step
        if x.problem is None:
            ids_check(*x.checked, self._num_rows, verdict, x.batch, x.narrowed)
        ids_header(
            verdict,
            x.values,
            x.offsets,
            x.lengths,
            x.weights,
            self._num_rows,
            self._runs,
            headers,
            chunks,
            x.batch,
            x.problem,
            layout,
            self._clock_send,
            self._me,
            buffers.depth,
            checked=x.checked[:2],
        )
        if text is not None:
            put_text(chunks, text)
            self._text = text  # until the next failing send: the puts read it
        put_signal(
            buffers.all_ranks,
            chunks,
            buffers.ids,
            buffers.ids_ready,
            buffers.ids_free,
            buffers.err,
            self._me,
            self._sent_step,
            buffers.depth,
            self._t.timeout_ns,
            self_row=self._me,
            done=put_done,
        )
        reported = x.batch if x.batch <= layout.batch_capacity else 0
        rows = _output_rows(kjt, reported, x.problem is not None, layout.batch_capacity)
        self._my_batches.append((reported, rows))
        return step

    # ---------------------------------------------------------------- receive

    def _recv(self, step: int, divisor: Optional[torch.Tensor]) -> LookupBatch:
        """Enqueues the wait for every source's slot of ``step`` and lays out the
        owner's lookup batch (see the module docstring)."""
        buffers, layout = self._buffers, self._layout
        assert buffers is not None and layout is not None, "recv_ids before send_ids"
        buffers.release_held()
        self._recv_step = step
        world, cap = self._t.world_size, layout.batch_capacity
        record = torch.empty(self._err_at + RECORD_WORDS, dtype=torch.int64, device=self._dev)
        ids_step = StepRef(record[self._err_at + RECORD_STEP :])
        features = len(self._features_per_rank[self._me])
        # Receives may come from several streams (pipelines).
        stream = driver.active.get_current_stream(self._dev.index)
        offsets = bag_offsets(
            buffers.ids,
            world,
            features,
            layout,
            record,
            self._scratch.scan(stream),
            self._clock_recv,
            buffers.ids_ready,
            buffers.err,
            self._t.timeout_ns,
        )
        training = torch.is_grad_enabled()
        my_batch, rows = self._my_batches.popleft()
        if divisor is not None and divisor.size(0) != rows:
            divisor = None  # an over-capacity batch: its output has no rows (its step raises)
        route = DeviceRoute(record, my_batch, rows, step=step, divisor=divisor, check_now=training)
        batch = LookupBatch(groups=[], route=route, bags_per_feature=world * cap)
        if features:
            if self._fused.enabled and (not training or self._update.enabled):
                # The lookup pools straight from the slots: they stay held until then
                # (``lookup_put`` decides whether the step is checked now).
                buffers.hold(step, ids_step)
                batch.from_slots = SlotsLookup(offsets, ids_step.word, step, stream)
                route.check_now = False
                return batch
            if self._group_tensors and not training:
                batch.groups = self._groups.tensors(buffers.ids, ids_step.word, offsets, stream)
            else:
                batch.groups = self._groups.kjts(buffers.ids, ids_step.word, offsets, exact=training)
        # Everything is read (stream ordered): release the slots to their sources.
        buffers.release(ids_step)
        return batch

    def _drop_step(self, step: int) -> None:
        buffers = self._buffers
        assert buffers is not None
        buffers.skip()
        self._my_batches.popleft()

    # ----------------------------------------------------------------- lookup

    def lookup_put(self, batch: LookupBatch, emb_modules: Sequence[Any]) -> Optional[torch.Tensor]:
        """Pools every requester's bags from the slots of ``batch.from_slots`` and puts
        the rows (``kernels/lookup_put``; ``exchange_pooled`` releases the slots); in
        training, also keys and sorts the step's ids for the fused update of its
        backward (``fused_update.py``). For tables it cannot read or update, fills
        ``batch.groups`` for TorchRec's lookup, releases the slots and returns None (as
        for a batch whose groups the receive filled)."""
        lookup, batch.from_slots = batch.from_slots, None
        training = torch.is_grad_enabled()
        updates = self._agreed_updates(emb_modules) if training else None
        if training:
            # Every rank alike (the plan's choice): a step whose backward is FBGEMM's
            # is checked before it can apply a bad step; the fused update skips one.
            batch.route.check_now = updates is None
        if lookup is None:
            return None
        buffers, layout, step = self._buffers, self._layout, lookup.step
        assert buffers is not None and layout is not None
        if buffers.held != step:
            raise PgasError(
                f"{self._name}: rank {self._me} looked up a batch whose ids were released "
                f"(later batches were received, or {DEFAULT_DEPTH} were sent, before its lookup)"
            )
        if driver.active.get_current_stream(self._dev.index) != lookup.stream:
            # A pipeline lays the batch out on its data-dist stream; the lookup runs on this one.
            lookup.offsets.record_stream(torch.cuda.current_stream(self._dev))
        tables = self._fused.rows(emb_modules)
        if tables is None or (training and updates is None):
            batch.groups = self._groups.kjts(buffers.ids, lookup.ids_step, lookup.offsets, exact=training)
            buffers.release_held()
            return None
        self._out_step += 1
        route = batch.route
        route.out = self._new_output(route)
        route.out_stream = driver.active.get_current_stream(self._dev.index)
        lookup_put(
            buffers.ids,
            lookup.ids_step,
            self._clock_out,
            lookup.offsets,
            tables,
            emb_modules[0].emb_module.weights_dev,
            route.out,
            self._own_rank,
            self._out_addrs,
            self._peers.my_counts,
            self._done,
            buffers.out_free,
            buffers.err,
            layout,
            self._output.dim,
            self._weighted,
            self._t.timeout_ns,
            put_path=self._peers.put_path,
        )
        # The slots stay held until the output's take releases them.
        route.ids_step = step
        if updates is None:
            return self._no_rows
        ids_dtype = self._update.ids_dtype(updates)
        ids = self._groups.kjts(
            buffers.ids, lookup.ids_step, lookup.offsets, exact=False, for_update=True, ids_dtype=ids_dtype
        )
        pitch = self._all_rows.shape[1]
        prepared = self._update.prepare(updates, ids, batch.bags_per_feature, pitch)
        update = PendingUpdate(self._update, updates, prepared, pitch, route.record, buffers.err, self._t.world_size)
        # At world size 1 the owner's gradient is the output's: the update reads it where
        # it is (``exchange_grads``), the output's rows then being the lookup's.
        route.grads_in_place = self._t.world_size == 1 and pitch == self._output.dim
        return update.output(self._all_rows[: route.out_rows] if route.grads_in_place else self._all_rows)

    def _agreed_updates(self, emb_modules: Sequence[Any]) -> Optional[List[GroupUpdate]]:
        """This rank's fused updates (``fused_update.py``; none for a rank without
        tables), or None if the plan's training steps take FBGEMM's backward: on every
        rank alike, decided at the first training step by every rank together (one
        read-back), since a rank's tables may qualify where another's do not, and the
        ranks must check a step at the same call."""
        if self._update_agreed is None:
            ok = self._update.enabled and self._fused.rows(emb_modules) is not None
            ok = ok and self._update.groups(emb_modules) is not None
            flag = torch.tensor([int(ok)], dtype=torch.int64, device=self._dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._t.group)
            self._update_agreed = bool(flag.item())
            self._update.enabled = self._update_agreed
        return self._update.groups(emb_modules) if self._update_agreed else None

    # ----------------------------------------------------------------- output

    def exchange_pooled(self, local_embs: torch.Tensor, route: DeviceRoute) -> torch.Tensor:
        """Puts every requester's rows (unless ``lookup_put`` did); returns this rank's
        output (see module doc)."""
        buffers, layout = self._buffers, self._layout
        assert buffers is not None and layout is not None
        me, out = self._me, self._output
        pooled, route.out = route.out, None  # the route may live on (autograd): not the output
        if pooled is None:
            pooled = self._new_output(route)
        elif route.out_stream != driver.active.get_current_stream(self._dev.index):
            # A lookup on another stream: its stores into the output come before the
            # take (which need not wait for them once the step is known bad).
            current = torch.cuda.current_stream(self._dev)
            current.wait_stream(torch.cuda.ExternalStream(route.out_stream, device=self._dev))
            pooled.record_stream(current)
        if not route.ids_step:  # else ``lookup_put`` put the rows (and counted the step)
            self._out_step += 1
            if self._dims[me] > 0:
                embs = local_embs.detach() if local_embs.requires_grad else local_embs
                rows_put(
                    embs.to(self._out_dtype).contiguous(),
                    route.record[1 : self._err_at : HEADER_WORDS],
                    pooled,
                    self._own_rank,
                    self._out_addrs,
                    self._peers.my_counts,
                    buffers.out_free,
                    buffers.err,
                    self._clock_out,
                    layout.batch_capacity,
                    out.dim,
                    out.col_offsets[me],
                    self._t.timeout_ns,
                    put_path=self._peers.put_path,
                )
        release_ids = buffers.hand_over(route.ids_step)  # False if released since
        self._keep(self._errors.make_room(self._out_step))
        # The other owners' rows are copied out of the slot: it is reused two steps on,
        # the output may live longer.
        output_take(
            buffers.out_slots,
            pooled,
            buffers.out_count.local,
            self._owners,
            self._peers.out_free_words,
            self._peers.ids_free_words,
            self._take_done,
            buffers.err,
            route.record,
            self._err_at,
            buffers.clock,
            programs_per_requester(route.my_batch),
            release_ids,
            self._errors.ring,
            self._t.timeout_ns,
            self._own_columns,
            put_path=self._peers.put_path,
        )
        if route.check_now:
            # Before the backward can apply a bad step's gradients (one read-back;
            # the receive under autograd has read one already).
            self._check(route)
        else:
            # Raised between steps (``raise_errors``), not in the middle of one.
            self._keep(self._errors.finished(self._out_step, wait=False))
        return pooled

    def output_spec(self, route: DeviceRoute) -> OutputSpec:
        """This rank's output of the step of ``route`` (``Exchange.output_spec``)."""
        return OutputSpec(route.out_rows, self._output.dim, self._out_dtype, self._dev, self._divides())

    def _new_output(self, route: DeviceRoute) -> torch.Tensor:
        """This rank's output of a step, ``[route.out_rows, dim]``: ``route.dest`` if the
        module gave one, else a new tensor."""
        shape = (route.out_rows, self._output.dim)
        if route.dest is None:
            return torch.empty(shape, dtype=self._out_dtype, device=self._dev)
        check_dest(route.dest, shape, self._out_dtype, self._name)
        return route.dest

    # -------------------------------------------------------------- gradients

    def exchange_grads(
        self, grad_out: torch.Tensor, route: DeviceRoute, local_embs_shape: torch.Size, divide: bool
    ) -> torch.Tensor:
        """Puts each owner's columns of ``grad_out`` (divided by the world size if
        ``divide``); returns the gradient of the local pooled embeddings in the lookup's
        (padded) row order."""
        buffers, layout = self._buffers, self._layout
        assert buffers is not None and layout is not None
        self._grad_step += 1
        if route.grads_in_place:
            # One source, every column, scale 1: the slot would hold a copy of it (the
            # clock's backward step and the slots' releases are then never used).
            return strided_rows(grad_out.to(self._out_dtype))
        cap = layout.batch_capacity
        owner = self._dims[self._me] > 0
        if owner:
            # The previous step's slots, before this step's puts (one generation):
            # FBGEMM's backward read them, and it is ordered before this (the same
            # stream, or, for a lookup on a stream of its own, through this step's
            # forward, whose output dist waited for its lookup).
            buffers.release_grads()
        grads_put(
            strided_rows(grad_out.to(self._out_dtype)),
            self._peers.grad_dests,
            buffers.grads_free,
            buffers.err,
            cap,
            step_clock.at(buffers.clock, GRAD, 1),
            GRAD_DEPTH,
            buffers.grad_slot_bytes,
            self._grad_scale if divide else 1.0,
            self._t.timeout_ns,
            put_path=self._peers.put_path,
        )
        # Ticks the clock's backward step (an owner of no table expects no rows).
        buffers.wait_grads(programs_per_source(cap) if owner else 0)
        if not owner:
            return grad_out.new_zeros(local_embs_shape)
        # A view of the slots, valid until the next backward releases them. Rows past a
        # source's batch belong to empty bags, which no backward reads.
        return buffers.grad_view


def _output_rows(kjt: KeyedJaggedTensor, batch: int, bad: bool, capacity: int) -> int:
    """The rows of this rank's output of a step whose header reported ``batch``
    samples: a bad batch is reported with size 0 (its data is not read, owners store
    no rows for it) but still gets a (NaN) output of its own size where that is known,
    so that a module joins it with the outputs of its other shardings, whose sends of
    the same batch may have gone through."""
    if bad:
        try:
            batch = int(kjt.stride())
        except Exception:  # noqa: BLE001 (a batch too broken to say its size)
            batch = 0
    return batch if 0 <= batch <= capacity else 0
