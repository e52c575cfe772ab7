"""The host exchange: one algorithm on a one-sided transport, for table-wise and row-wise
shardings alike, configured by how ids are routed (``host_routing.HostIdsRouting``)
and where owners put pooled rows (``host_routing.HostOutput``). Table-wise (the
default strategies) forward, for a step ``k``:

1. ``send_ids``: every source puts, for every owner, a slot with the lengths, ids and
   weights of the features whose tables that owner holds, then signals it. No sizes
   are exchanged: each source has its own slot at each owner.
2. ``recv_ids``: an owner waits for the slots of all sources and forms the KJT its
   lookup pools: each feature's bags of source 0, then of source 1, ...
3. ``exchange_pooled``: the owner puts the pooled rows of source ``s`` straight into
   ``s``'s output, at the column block of the owner's tables, and signals ``s``; each
   requester waits for the owners that hold any table. No permute is needed after.

Backward: ``exchange_grads`` puts each owner's column block of the output gradient
into that owner's per-source slot; the owner stacks them in lookup order and hands
them to TorchRec's lookup, whose fused optimizer applies the update.

Row-wise (``rw_exchange``) routes ids by row block and has every owner put whole
partial rows, which the requester sums; its owners' column blocks are every column.
"""

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.ids_slot import Header, IdsSlotLayout, Status
from torchrec_pgas.sharding.exchange import HostBatch, OutputSpec, check_dest
from torchrec_pgas.sharding.host_routing import ColumnBlockOutput, HostIdsRouting, HostOutput, TableWiseHostIds
from torchrec_pgas.sharding.tw_base import BaseTwExchange, PgasInputError
from torchrec_pgas.transport import Mailbox, Transport


@dataclass
class Route:
    """What the output and gradient exchanges of one step need from its input:
    every source's batch size, what this rank's summed output is divided by (mean
    pooling of row-wise partial sums), if anything, and where it goes, if the module
    says (``StepRoute``)."""

    batch_sizes: List[int]
    divisor: Optional[torch.Tensor] = None
    dest: Optional[torch.Tensor] = None


class TwExchange(BaseTwExchange):
    """Moves one sharding's ids, pooled rows and gradients through any ``Transport``
    with host-side sizes (the host transport): the arguments of ``BaseTwExchange``,
    plus which owner gets which ids (``routing``, default ``TableWiseHostIds``) and
    where owners put pooled rows (``output``, default ``ColumnBlockOutput``: each owner
    at its columns). ``RwExchange`` gives it the row-wise ones."""

    _ids: Optional[Mailbox] = None
    _out: Optional[Mailbox] = None
    _grads: Optional[Mailbox] = None

    def __init__(
        self,
        transport: Transport,
        routing: Optional[HostIdsRouting] = None,
        output: Optional[HostOutput] = None,
        **plan: Any,
    ) -> None:
        super().__init__(transport, **plan)
        self._routing: HostIdsRouting = routing if routing is not None else TableWiseHostIds()
        self._output: HostOutput = output if output is not None else ColumnBlockOutput(self._dims, transport.rank)

    # ----------------------------------------------------------------- set-up

    def _allocate(self, batch_size: int, max_ids: int) -> None:
        """Sizes the buffers from the largest first batch of any rank (collective)."""
        per_sample = -(-max_ids // batch_size) if batch_size else 0
        sizes = torch.tensor([batch_size, max_ids, per_sample], dtype=torch.int64)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self._t.group)
        max_features = max(len(f) for f in self._features_per_rank)
        batch, ids, per_sample = sizes.tolist()
        layout = IdsSlotLayout.for_batch(max_features, batch, ids, self._capacity, per_sample)
        elem = self._elem
        rows = layout.batch_capacity
        self._ids = Mailbox(self._t, layout.nbytes, True, f"{self._name} ids")
        self._out = Mailbox(
            self._t, rows * self._dim_total * elem, self._output.per_source, f"{self._name} pooled rows"
        )
        self._grads = Mailbox(self._t, rows * max(self._dims) * elem, True, f"{self._name} gradients")
        self._layout = layout  # last: set only once every buffer is

    # ------------------------------------------------------------ ids forward

    def _check(self, kjt: KeyedJaggedTensor, lengths: torch.Tensor) -> Header:
        """The status this source reports for ``kjt``, the batch as the sharding's input
        dist receives it, once ``_host_problem`` found nothing (before any capacity
        check)."""
        batch = kjt.stride()
        ok = Header(Status.OK, batch, 0, kjt.weights_or_none() is not None, ())
        negative = torch.nonzero(lengths < 0)
        if negative.numel():
            feature = int(negative[0, 0]) // batch
            return Header(Status.BAD_LENGTHS, batch, 0, False, (feature,))
        per_key = lengths.view(len(self._num_rows), batch).sum(1)
        if int(per_key.sum()) != kjt.values().numel():
            return Header(Status.BAD_LENGTHS, batch, 0, False, (-1,))
        values = kjt.values()
        limits = torch.repeat_interleave(self._num_rows, per_key)
        bad = (values < 0) | (values >= limits)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0, 0])
            feature = int(torch.searchsorted(per_key.cumsum(0), i, right=True))
            return Header(
                Status.ID_OUT_OF_RANGE,
                batch,
                0,
                False,
                (feature, int(values[i]), int(self._num_rows[feature])),
            )
        return ok

    def _by_owner(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with each owner's features contiguous, owner by owner (``routing``)."""
        return self._routing.by_owner(kjt, self._input_pos if self._reordered else None)

    def _send(self, kjt: KeyedJaggedTensor) -> int:
        self._t.check_alive(self._name)
        problem = self._host_problem(kjt)
        if problem is not None:
            status, detail, batch_size = problem
            header = Header(status, batch_size, 0, False, detail)
        else:
            header = self._check(kjt, kjt.lengths())
        counts = [len(f) for f in self._features_per_rank]
        ok = header.status == Status.OK
        if ok:
            kjt = self._by_owner(kjt)
            batch = header.batch_size
            lengths = kjt.lengths().to(torch.int32)
            per_key = lengths.view(len(self._features), batch).sum(1)
            ids_per_owner = [int(s.sum()) for s in per_key.split(counts)]
        else:
            ids_per_owner = [0] * len(counts)
        if self._layout is None:
            self._allocate_once(header.batch_size, max(ids_per_owner))
        layout, box = self._layout, self._ids
        assert layout is not None and box is not None
        if ok and not layout.fits(header.batch_size, max(ids_per_owner)):
            header = Header(Status.OVER_CAPACITY, header.batch_size, 0, False, (header.batch_size, max(ids_per_owner)))
            ok = False
        text = None
        if header.status == Status.FAILED:
            text = self._failure_text(layout)
            header = Header(Status.FAILED, 0, 0, False, (text.numel(),))
        parts: List[tuple] = [()] * len(counts)
        if ok:
            weights = kjt.weights_or_none()
            parts = list(
                zip(
                    lengths.split([c * header.batch_size for c in counts]),
                    kjt.values().to(torch.int64).split(ids_per_owner),
                    weights.to(torch.float32).split(ids_per_owner) if weights is not None else [None] * len(counts),
                )
            )

        self._make_room()
        self._send_step += 1
        step = self._send_step
        for owner in range(self._t.world_size):
            base = box.begin_send(owner, step)
            owner_header = Header(
                header.status, header.batch_size, ids_per_owner[owner], header.has_weights, header.detail
            )
            self._t.put(box.buffer, owner, base, owner_header.encode())
            if ok:
                owner_lengths, ids, w = parts[owner]
                self._t.put(box.buffer, owner, base + layout.lengths_offset, owner_lengths)
                self._t.put(box.buffer, owner, base + layout.ids_offset, ids)
                if w is not None:
                    self._t.put(box.buffer, owner, base + layout.weights_offset, w)
            elif text is not None and text.numel():
                self._t.put(box.buffer, owner, base + layout.lengths_offset, text)
            box.end_send(owner, step)
        return step

    def _drop_step(self, step: int) -> None:
        box = self._ids
        assert box is not None
        for source in range(self._t.world_size):
            box.wait(source, step)
            box.release(source, step)

    def _recv(self, step: int, divisor: Optional[torch.Tensor]) -> HostBatch:
        """Waits for every source's slot of ``step``; returns the owner's KJT and the
        step's route."""
        box, layout = self._ids, self._layout
        assert box is not None and layout is not None, "recv_ids before send_ids"
        self._recv_step = step
        me = self._t.rank
        features = self._features_per_rank[me]
        nf = len(features)
        headers, texts, lengths, ids, weights = [], [], [], [], []
        for source in range(self._t.world_size):
            box.wait(source, step)
            slot = box.slot(source, step)
            h = layout.header(slot)
            headers.append(h)
            texts.append(layout.text(slot, h.detail[0]) if h.status == Status.FAILED else "")
            if h.status == Status.OK:
                ln = layout.lengths(slot, nf * h.batch_size).view(nf, h.batch_size).clone()
                lengths.append(ln)
                per_feature = ln.sum(1).tolist()
                ids.append(layout.ids(slot, h.num_ids).clone().split(per_feature))
                if h.has_weights:
                    weights.append(layout.weights(slot, h.num_ids).clone().split(per_feature))
            box.release(source, step)
        self._raise_for_bad_headers(headers, step, texts)
        has_weights = {h.has_weights for h in headers}
        if len(has_weights) > 1:
            raise PgasInputError(f"{self._name} step {step}: some ranks sent per-sample weights and some did not")
        order = range(self._t.world_size)
        values = torch.cat([ids[s][f] for f in range(nf) for s in order] or [torch.empty(0, dtype=torch.int64)])
        kjt = KeyedJaggedTensor(
            keys=[f.name for f in features],
            values=values,
            lengths=torch.cat(lengths, dim=1).view(-1) if lengths else torch.empty(0, dtype=torch.int32),
            weights=torch.cat([weights[s][f] for f in range(nf) for s in order] or [torch.empty(0)])
            if has_weights == {True}
            else None,
            stride=sum(h.batch_size for h in headers),
        )
        return HostBatch(kjt, Route([h.batch_size for h in headers], divisor))

    # ---------------------------------------------------------- pooled forward

    def output_spec(self, route: Route) -> OutputSpec:
        """This rank's output of the step of ``route`` (``Exchange.output_spec``)."""
        rows = route.batch_sizes[self._t.rank]
        return OutputSpec(rows, self._output.width, self._out_dtype, self._t.device, self._divides())

    def exchange_pooled(self, local_embs: torch.Tensor, route: Route) -> torch.Tensor:
        """Puts each requester's pooled rows into its output slot; returns this rank's
        output (``output`` says where the rows go and how they are combined)."""
        box = self._out
        assert box is not None
        self._t.check_alive(self._name)
        self._out_step += 1
        step = self._out_step
        me = self._t.rank
        if self._dims[me] > 0:
            rows = local_embs.detach().to(self._out_dtype).split(route.batch_sizes)
            for requester, block in enumerate(rows):
                base = box.begin_send(requester, step)
                self._output.put(self._t, box.buffer, requester, base, block)
                box.end_send(requester, step)
        rows = route.batch_sizes[me]
        if route.dest is not None:
            check_dest(route.dest, (rows, self._output.width), self._out_dtype, self._name)
        return self._output.take(box, step, rows, self._out_dtype, route.dest)

    # ---------------------------------------------------------------- backward

    def exchange_grads(
        self, grad_out: torch.Tensor, route: Route, local_embs_shape: torch.Size, divide: bool
    ) -> torch.Tensor:
        """Puts each owner's block of ``grad_out`` (its columns, from
        ``output.col_offsets``: row-wise, every column); returns the gradient of the
        local pooled embeddings, rows in lookup order (divided by the world size if
        ``divide``)."""
        box = self._grads
        assert box is not None
        self._t.check_alive(self._name)
        self._grad_step += 1
        step = self._grad_step
        me = self._t.rank
        grad_out = grad_out.to(self._out_dtype)
        for owner in self._owners_with_tables:
            c0 = self._output.col_offsets[owner]
            base = box.begin_send(owner, step)
            self._t.put(box.buffer, owner, base, grad_out[:, c0 : c0 + self._dims[owner]].contiguous())
            box.end_send(owner, step)
        if self._dims[me] == 0:
            return grad_out.new_zeros(local_embs_shape)
        blocks = []
        for source, batch in enumerate(route.batch_sizes):
            box.wait(source, step)
            nbytes = batch * self._dims[me] * grad_out.element_size()
            blocks.append(box.slot(source, step)[:nbytes].view(self._out_dtype).view(batch, self._dims[me]).clone())
            box.release(source, step)
        return self._divided(torch.cat(blocks), divide)
