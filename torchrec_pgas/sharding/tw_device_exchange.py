"""The table-wise algorithm on GPUs: NVSHMEM puts and signals from Triton kernels.

The steps are those of ``tw_exchange`` (read it first); what differs is that no size
ever travels to the host. Every size a kernel needs (ids per owner, batch sizes of the
sources, bag offsets) is computed on the device and read by the kernels, so the host
only enqueues work:

* ``send_ids``: one ``put_signal`` launch puts header, lengths, ids and weights into
  every owner's slot and signals it. A batch with bad ids is sent with empty bags and
  a status in its header, so owners never index out of bounds.
* ``recv_ids``: a device-side wait, then the lookup batch is laid out with a fixed
  number of bags: bag ``(f, s, b)`` for every source ``s`` and ``b < batch_capacity``,
  bags past a source's batch size empty. The ids are gathered into place by
  ``gather_ids``; their total is read back once, as FBGEMM's backward needs an index
  tensor of exactly that size.
* ``exchange_pooled``: ``rows_put`` stores each requester's rows straight into its
  output (peer mapping) and counts them in; the requester waits for its count, copies
  its output out of the slot, releases it, and reads the step's statuses and the
  transport's error record once.
* ``exchange_grads``: each owner's gradient block is put into its per-source slot;
  the owner hands the slots, in lookup order, to FBGEMM's backward, whose fused
  optimizer applies the update exactly as under ``table_wise``.
"""

import collections
from dataclasses import dataclass
from typing import Any, Deque, List, Sequence

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.gather_ids import gather_ids
from torchrec_pgas.kernels.put_signal import put_signal
from torchrec_pgas.kernels.rows_put import programs_per_requester, rows_put
from torchrec_pgas.kernels.signal_wait import signal_wait
from torchrec_pgas.kernels.signals import WAIT_DATA
from torchrec_pgas.sharding.ids_slot import HEADER_WORDS, Header, IdsSlotLayout, Status
from torchrec_pgas.sharding.tw_base import BaseTwExchange, PgasInputError, attach_route
from torchrec_pgas.transport.mailbox import DEFAULT_DEPTH
from torchrec_pgas.transport.nvshmem import NvshmemTransport

_WAIT_DATA = WAIT_DATA.value


@dataclass
class LookupBatch:
    """The owner's lookup input of one step: per lookup group, the bag offsets and ids
    (and weights) of ``bags_per_feature`` bags per feature. ``headers`` are the step's slot
    headers ([S, 8] int64, on the device)."""

    groups: List[KeyedJaggedTensor]
    headers: torch.Tensor
    bags_per_feature: int

    # TorchRec inspects the input dist's output as a KJT in a few places.
    def variable_stride_per_key(self) -> bool:
        return False

    def stride(self) -> int:
        return self.bags_per_feature

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for kjt in self.groups:
            kjt.record_stream(stream)
        self.headers.record_stream(stream)


@dataclass
class DeviceRoute:
    """What the output and gradient exchanges of a step need from its input."""

    headers: torch.Tensor  # [S, 8] int64: every source's header of the step
    my_batch: int  # this rank's batch size as its header reports it


class _Symmetric:
    """A symmetric tensor with the addresses of every rank's copy."""

    def __init__(self, t: NvshmemTransport, shape, dtype) -> None:
        self.local = t._tensor(shape, dtype)
        self.peers = t.peer_addresses(self.local)


class DeviceTwExchange(BaseTwExchange):
    """GPU counterpart of ``TwExchange``: the arguments of ``BaseTwExchange``, plus the
    number of features of each lookup group of this rank (``group_sizes``, in lookup
    order) and whether the plan's tables are weighted."""

    def __init__(
        self,
        transport: NvshmemTransport,
        group_sizes: Sequence[int],
        weighted: bool,
        **plan: Any,
    ) -> None:
        super().__init__(transport, **plan)
        self._t: NvshmemTransport = transport
        self._dev = transport.device
        self._counts = [len(f) for f in self._features_per_rank]
        self._group_sizes = list(group_sizes)
        self._weighted = weighted
        self._me = transport.rank
        self._all = torch.arange(transport.world_size, dtype=torch.int32, device=self._dev)
        self._owners = torch.tensor(self._owners_with_tables, dtype=torch.int32, device=self._dev)
        self._expected_rows = 0
        self._my_batches: Deque[int] = collections.deque()

    # ----------------------------------------------------------------- set-up

    def _allocate(self, batch_size: int, ids_per_owner: torch.Tensor) -> None:
        """Sizes the buffers from the largest first batch of any rank (collective,
        and the one device-to-host sync of the set-up)."""
        sizes = torch.stack([torch.tensor(batch_size, device=self._dev), ids_per_owner.max()])
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self._t.group)
        batch, ids = sizes.tolist()
        self._layout = layout = IdsSlotLayout.for_batch(max(self._counts), batch, ids, self._headroom)
        t, world, depth = self._t, self._t.world_size, DEFAULT_DEPTH
        rows = layout.batch_capacity
        self._ids = t._tensor((depth * world * layout.nbytes,), torch.uint8)
        self._ids_ready = t._tensor((world,), torch.int64)
        self._ids_free = t._tensor((world,), torch.int64)
        self._out_slot = rows * self._dim_total * self._elem
        self._out = _Symmetric(t, (depth * self._out_slot,), torch.uint8)
        self._out_count = _Symmetric(t, (world,), torch.int64)
        self._out_free = t._tensor((world,), torch.int64)
        self._grad_slot = rows * max(self._dims) * self._elem
        self._grads = t._tensor((depth * world * self._grad_slot,), torch.uint8)
        self._grads_ready = t._tensor((world,), torch.int64)
        self._grads_free = t._tensor((world,), torch.int64)
        torch.cuda.synchronize(self._dev)
        t.barrier()

    def _ids_slot_offset(self, source: int, step: int) -> int:
        assert self._layout is not None
        return ((step % DEFAULT_DEPTH) * self._t.world_size + source) * self._layout.nbytes

    # ------------------------------------------------------------ ids forward

    def send_ids(self, kjt: KeyedJaggedTensor) -> None:
        """Puts this rank's ids for the next step into every owner's slot."""
        self._check_keys(kjt.keys())
        if kjt.variable_stride_per_key():
            raise PgasInputError(f"{self._name}: variable batch per feature is not supported")
        batch, nf = kjt.stride(), len(self._features)
        raw_values, weights = kjt.values(), kjt.weights_or_none()
        values = raw_values.to(torch.int64)
        lengths = kjt.lengths().to(torch.int32)
        per_key = lengths.view(nf, batch).sum(1)
        ids_per_owner = torch.stack([c.sum() for c in per_key.split(self._counts)])
        if self._layout is None:
            self._allocate(batch, ids_per_owner)
        layout = self._layout
        assert layout is not None

        status, detail = self._validate(raw_values, weights, lengths, per_key, ids_per_owner, batch, layout)
        ok = status == Status.OK
        sent_batch = batch if batch <= layout.batch_capacity else 0
        self._my_batches.append(sent_batch)
        world = self._t.world_size
        header = torch.zeros(world, HEADER_WORDS, dtype=torch.int64, device=self._dev)
        header[:, 0] = status
        header[:, 1] = sent_batch
        header[:, 2] = torch.where(ok, ids_per_owner, 0)
        header[:, 3] = int(weights is not None)
        header[:, 4:7] = detail
        first_feature = torch.tensor([0] + self._counts[:-1], device=self._dev).cumsum(0)
        id_start = torch.cumsum(ids_per_owner, 0) - ids_per_owner
        counts = torch.tensor(self._counts, dtype=torch.int64, device=self._dev)

        self._send_step += 1
        step = self._send_step
        dst = torch.full((world,), self._ids_slot_offset(self._me, step), dtype=torch.int64, device=self._dev)
        w = weights.to(torch.float32) if weights is not None else values  # any address will do
        chunks = torch.stack(
            [
                torch.stack([dst, header.data_ptr() + self._all.long() * 64,
                             torch.full_like(id_start, 64)], 1),
                torch.stack([dst + layout.lengths_offset,
                             lengths.data_ptr() + first_feature * batch * 4,
                             torch.where(ok, counts * batch * 4, 0)], 1),
                torch.stack([dst + layout.ids_offset, values.data_ptr() + id_start * 8,
                             torch.where(ok, ids_per_owner * 8, 0)], 1),
                torch.stack([dst + layout.weights_offset, w.data_ptr() + id_start * 4,
                             torch.where(ok & (weights is not None), ids_per_owner * 4, 0)], 1),
            ],
            1,
        )
        put_signal(
            self._all, chunks, self._ids, self._ids_ready, self._ids_free, self._t.err,
            self._me, step, max(step - DEFAULT_DEPTH, 0), self._t.timeout_ns,
        )

    def _validate(self, values, weights, lengths, per_key, ids_per_owner, batch, layout):
        """Status and detail words of this rank's batch, computed on the device."""
        dev = self._dev
        nf = len(self._features)
        limits = torch.repeat_interleave(self._num_rows, per_key, output_size=values.numel())
        bad = (values < 0) | (values >= limits)
        first = torch.argmax(bad.to(torch.int32)) if values.numel() else torch.zeros((), dtype=torch.int64, device=dev)
        feature = torch.searchsorted(per_key.cumsum(0), first, right=True).clamp(max=max(nf - 1, 0))
        # index_select, not values[first]: indexing with a tensor would sync
        bad_id = values.index_select(0, first.reshape(1)).squeeze(0) if values.numel() else first
        negative = (lengths < 0).any()
        mismatch = per_key.sum() != values.numel()
        over = ids_per_owner.max() > layout.ids_capacity
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        status = torch.full((), Status.OK, dtype=torch.int64, device=dev)
        detail = torch.zeros(3, dtype=torch.int64, device=dev)
        bad_dtype = self._dtype_problem(values, weights)
        if bad_dtype is not None:
            status.fill_(Status.BAD_DTYPE)
            detail[0] = bad_dtype
            return status, detail
        if batch > layout.batch_capacity:
            status.fill_(Status.OVER_CAPACITY)
            detail[0], detail[1] = batch, ids_per_owner.max()
            return status, detail
        status = torch.where(bad.any(), Status.ID_OUT_OF_RANGE, status)
        detail = torch.where(bad.any(), torch.stack([feature, bad_id, self._num_rows.index_select(0, feature.reshape(1)).squeeze(0)]), detail)
        status = torch.where(over, Status.OVER_CAPACITY, status)
        detail = torch.where(over, torch.stack([zero + batch, ids_per_owner.max(), zero]), detail)
        status = torch.where(negative | mismatch, Status.BAD_LENGTHS, status)
        detail = torch.where(negative | mismatch, torch.stack([zero - 1, zero, zero]), detail)
        return status, detail

    def recv_ids(self) -> LookupBatch:
        """Enqueues the wait for every source's slot of the next step and lays out the
        owner's lookup batch (see the module docstring)."""
        layout = self._layout
        assert layout is not None, "recv_ids before send_ids"
        self._recv_step += 1
        step = self._recv_step
        world, cap = self._t.world_size, layout.batch_capacity
        signal_wait(self._ids_ready, self._all, step, self._t.err, _WAIT_DATA, self._t.timeout_ns)
        base = self._ids_slot_offset(0, step)
        slots = self._ids[base : base + world * layout.nbytes].view(world, layout.nbytes)
        headers = slots[:, : 8 * HEADER_WORDS].view(torch.int64).clone()
        features = self._features_per_rank[self._me]
        nf = len(features)
        groups: List[KeyedJaggedTensor] = []
        if nf:
            batch = headers[:, 1]
            lens = slots[:, layout.lengths_offset : layout.lengths_offset + 4 * layout.max_features * cap]
            lens = lens.view(torch.int32).view(world, -1)
            f = torch.arange(nf, device=self._dev)[:, None, None]
            b = torch.arange(cap, device=self._dev)[None, None, :]
            index = (f * batch[None, :, None] + b).clamp(max=lens.size(1) - 1)  # [F, S, cap]
            gathered = torch.gather(lens, 1, index.permute(1, 0, 2).reshape(world, -1))
            valid = (b < batch[None, :, None]) & (headers[:, 0] == Status.OK)[None, :, None]
            bags = torch.where(valid, gathered.view(world, nf, cap).permute(1, 0, 2), 0).long()
            counts = bags.sum(-1)  # [F, S]
            slot_starts = (torch.cumsum(counts, 0) - counts).t().contiguous()  # [S, F]
            has_weights = self._weighted
            # FBGEMM's backward sorts the whole index tensor, so each group's ids must
            # be exactly as many as its bags hold: the one size this rank reads back.
            group_bags = list(bags.split(self._group_sizes))
            totals = torch.stack([g.sum() for g in group_bags]).tolist()
            first = 0
            for size, g_bags, total in zip(self._group_sizes, group_bags, totals):
                g_bags = g_bags.reshape(-1)
                offsets = torch.zeros(g_bags.numel() + 1, dtype=torch.int64, device=self._dev)
                torch.cumsum(g_bags, 0, out=offsets[1:])
                indices = torch.empty(total, dtype=torch.int64, device=self._dev)
                weights = torch.empty(total if has_weights else 1, dtype=torch.float32, device=self._dev)
                gather_ids(
                    self._ids[base:], slot_starts[:, first : first + size].contiguous(),
                    counts[first : first + size].contiguous(), offsets, indices, weights,
                    layout.nbytes, layout.ids_offset, layout.weights_offset, cap, has_weights,
                )
                groups.append(
                    KeyedJaggedTensor(
                        keys=[x.name for x in features[first : first + size]],
                        values=indices,
                        offsets=offsets,
                        weights=weights if has_weights else None,
                        stride=world * cap,
                    )
                )
                first += size
        # Everything is read (stream ordered): release the slots to their sources.
        self._signal(self._all, self._ids_free, step)
        route = DeviceRoute(headers=headers, my_batch=self._my_batches.popleft())
        return attach_route(
            LookupBatch(groups=groups, headers=headers, bags_per_feature=world * cap),
            route,
        )

    def _signal(self, peers: torch.Tensor, sig: torch.Tensor, step: int) -> None:
        """Sets word ``me`` of ``sig`` at every peer to ``step``."""
        put_signal(
            peers, torch.empty(peers.numel(), 0, 3, dtype=torch.int64, device=self._dev),
            self._ids, sig, sig, self._t.err, self._me, step, 0, self._t.timeout_ns,
        )

    # ---------------------------------------------------------- pooled forward

    def exchange_pooled(self, local_embs: torch.Tensor, route: DeviceRoute) -> torch.Tensor:
        """Puts every requester's rows; returns this rank's output (see module doc)."""
        layout = self._layout
        assert layout is not None
        self._out_step += 1
        step = self._out_step
        me, gen = self._me, step % DEFAULT_DEPTH
        if self._dims[me] > 0:
            rows_put(
                local_embs.detach().to(self._out_dtype).contiguous(),
                route.headers[:, 1].contiguous(),
                self._out.peers + gen * self._out_slot,
                self._out_count.peers + me * 8,
                self._out_free, self._t.err, layout.batch_capacity, self._dim_total,
                self._col_offsets[me], max(step - DEFAULT_DEPTH, 0), self._t.timeout_ns,
            )
        self._expected_rows += programs_per_requester(route.my_batch)
        signal_wait(self._out_count.local, self._owners, self._expected_rows, self._t.err, _WAIT_DATA, self._t.timeout_ns)
        slot = self._out.local[gen * self._out_slot :]
        out = (
            slot[: route.my_batch * self._dim_total * self._elem]
            .view(self._out_dtype)
            .view(route.my_batch, self._dim_total)
            .clone()  # the slot is reused two steps on, the output may live longer
        )
        self._signal(self._owners, self._out_free, step)
        self._check(route.headers)
        return out

    def _check(self, headers: torch.Tensor) -> None:
        """Raises what the step's headers or the device-side waits report (one sync)."""
        record = torch.cat([headers.reshape(-1), self._t.err]).tolist()
        if record[-4]:  # the error record's code word
            self._t.check(self._name)
        n = HEADER_WORDS
        self._raise_for_bad_headers(
            [Header.decode(record[n * s : n * s + n]) for s in range(self._t.world_size)],
            self._out_step,
        )

    # ---------------------------------------------------------------- backward

    def exchange_grads(
        self, grad_out: torch.Tensor, route: DeviceRoute, local_embs_shape: torch.Size
    ) -> torch.Tensor:
        """Puts each owner's block of ``grad_out``; returns the gradient of the local
        pooled embeddings in the lookup's (padded) row order."""
        layout = self._layout
        assert layout is not None
        self._grad_step += 1
        step = self._grad_step
        me, world, cap = self._me, self._t.world_size, layout.batch_capacity
        grad_out = grad_out.to(self._out_dtype)
        blocks = [grad_out[:, self._col_offsets[o] : self._col_offsets[o] + self._dims[o]].contiguous() for o in self._owners_with_tables]
        dst = ((step % DEFAULT_DEPTH) * world + me) * self._grad_slot
        chunks = torch.tensor(
            [[[dst, b.data_ptr(), b.numel() * self._elem]] for b in blocks], dtype=torch.int64
        ).to(self._dev, non_blocking=True)
        put_signal(
            self._owners, chunks, self._grads, self._grads_ready, self._grads_free, self._t.err,
            me, step, max(step - DEFAULT_DEPTH, 0), self._t.timeout_ns,
        )
        if self._dims[me] == 0:
            return grad_out.new_zeros(local_embs_shape)
        signal_wait(self._grads_ready, self._all, step, self._t.err, _WAIT_DATA, self._t.timeout_ns)
        base = (step % DEFAULT_DEPTH) * world * self._grad_slot
        slots = self._grads[base : base + world * self._grad_slot].view(world, self._grad_slot)
        d = self._dims[me]
        grad = slots[:, : cap * d * self._elem].view(self._out_dtype).view(world * cap, d).clone()
        self._signal(self._all, self._grads_free, step)
        # Rows past a source's batch belong to empty bags: FBGEMM's backward never reads them.
        return grad
