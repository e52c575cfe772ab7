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
  source's batch size empty; ``gather_ids`` copies the ids into place. Under autograd
  the index tensor must hold exactly the batch's ids (FBGEMM's backward sorts all of
  it), which costs one read-back; without autograd it has the slots' capacity and
  FBGEMM reads only what the offsets cover (its bounds check is off: sources have
  checked every id).
* ``exchange_pooled``: ``rows_put`` stores each requester's rows straight into its
  output slot (peer mapping) and counts them in (or ``lookup_put`` did); the
  requester's ``output_take`` waits for its count, copies its output out of the slot,
  releases the slot (and the ids slots ``lookup_put`` pooled from) and copies the
  transport's error record next to the step's headers, which the host reads in one
  read-back (a second one only to report a timed-out wait).
* ``exchange_grads``: ``grads_put`` stores each owner's columns of the output gradient
  (divided as TorchRec divides them) straight into the owner's per-source slot; the
  owner's slots of a step are the gradient, in lookup order, that FBGEMM's backward
  takes without a copy, whose fused optimizer applies the update exactly as under
  ``table_wise``. The owner releases them at its next backward, after FBGEMM's.
"""

import collections
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from triton.runtime.driver import driver

from torchrec_pgas.kernels.bag_offsets import bag_offsets, scan_state
from torchrec_pgas.kernels.gather_ids import gather_ids
from torchrec_pgas.kernels.grads_put import grads_put, programs_per_source
from torchrec_pgas.kernels.ids_check import NONE, ids_check
from torchrec_pgas.kernels.ids_header import feature_runs, ids_header, runs_of
from torchrec_pgas.kernels.lookup_put import done_counters, lookup_put
from torchrec_pgas.kernels.output_take import output_take
from torchrec_pgas.kernels.put_signal import arrived, put_signal
from torchrec_pgas.kernels.rows_put import programs_per_requester, rows_put
from torchrec_pgas.kernels.signal_wait import signal_wait
from torchrec_pgas.kernels.signals import WAIT_DATA
from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, BadDtype, Header, IdsSlotLayout, Status
from torchrec_pgas.sharding.tw_base import BaseTwExchange, attach_route, route_of
from torchrec_pgas.transport import PgasError
from torchrec_pgas.transport.mailbox import DEFAULT_DEPTH
from torchrec_pgas.transport.nvshmem import NvshmemTransport

_WAIT_DATA = WAIT_DATA.value
#: The most runs of consecutive features an owner's part of a batch may take: each run
#: is three of ``put_signal``'s unrolled puts. A batch order that scatters an owner's
#: features more goes TorchRec's way (permuted into the sharding's order).
MAX_RUNS = 8
_FLOATS = {torch.float32, torch.float16, torch.bfloat16}


@dataclass
class LookupBatch:
    """The owner's lookup input of one step: per lookup group, the bag offsets and ids
    (and weights) of ``bags_per_feature`` bags per feature. ``record`` is the step's
    (see ``DeviceRoute``).

    Without autograd the groups are left empty at first: ``lookup_put`` then pools the
    bags straight from the slots and puts the rows (see ``DeviceTwExchange._lookup_put``),
    or fills the groups for TorchRec's lookup."""

    groups: List[KeyedJaggedTensor]
    record: torch.Tensor
    bags_per_feature: int
    pending: Optional[Callable[["LookupBatch", Sequence[Any]], Optional[torch.Tensor]]] = None

    def lookup_put(self, emb_modules: Sequence[Any]) -> Optional[torch.Tensor]:
        """Pools and puts this batch with ``emb_modules``' tables, if the exchange can;
        returns None once ``groups`` are filled for TorchRec's lookup instead."""
        pending, self.pending = self.pending, None
        return pending(self, emb_modules) if pending is not None else None

    # TorchRec inspects the input dist's output as a KJT in a few places.
    def variable_stride_per_key(self) -> bool:
        return False

    def stride(self) -> int:
        return self.bags_per_feature

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for kjt in self.groups:
            kjt.record_stream(stream)
        self.record.record_stream(stream)
        divisor = getattr(route_of(self, "lookup batch"), "divisor", None)
        if divisor is not None:  # row-wise mean: divides the output on that stream
            divisor.record_stream(stream)


@dataclass
class DeviceRoute:
    """What the output and gradient exchanges of a step need from its input."""

    # int64 [S * 8 + 4], on the device: every source's header of the step, then the
    # error record once the step's output has arrived (one read-back for both).
    record: torch.Tensor
    my_batch: int  # this rank's batch size as its header reports it
    # The rows were put by ``lookup_put``, pooled straight from the ids slots of this
    # step, which go back to their sources with the output's slot (0: not so).
    ids_step: int = 0
    divisor: Optional[torch.Tensor] = None  # row-wise mean pooling: [batch, dims]


class _SendScratch(NamedTuple):
    verdict: torch.Tensor  # int64 [2], see ``ids_check``
    headers: torch.Tensor  # int64 [W, 8], see ``ids_header``
    chunks: torch.Tensor  # int64 [W, 3R + 1, 3], see ``ids_header``


class _Symmetric:
    """A symmetric tensor with the addresses of every rank's copy."""

    def __init__(self, t: NvshmemTransport, shape, dtype) -> None:
        self.local = t._tensor(shape, dtype)
        self.peers = t.peer_addresses(self.local)


def _per_owner(counts: Sequence[int], pos: Sequence[int]) -> List[List[int]]:
    """``pos`` (per input feature of the sharding, owner by owner) cut into each
    owner's part, ``counts[w]`` features for owner ``w``."""
    starts = [sum(counts[:w]) for w in range(len(counts))]
    return [list(pos[s : s + c]) for s, c in zip(starts, counts)]


class DeviceTwExchange(BaseTwExchange):
    """GPU counterpart of ``TwExchange``: the arguments of ``BaseTwExchange``, plus the
    number of features of each lookup group of this rank (``group_sizes``, in lookup
    order), whether the plan's tables are weighted, whether the lookup reads only the
    bags' ids (else it gets exactly the batch's ids), and whether inference may pool
    with ``lookup_put`` (every group FBGEMM ``FUSED``, sum or mean pooling, no feature
    processor)."""

    def __init__(
        self,
        transport: NvshmemTransport,
        group_sizes: Sequence[int],
        weighted: bool,
        lookup_reads_only_bags: bool,
        fused_lookup: bool,
        **plan: Any,
    ) -> None:
        super().__init__(transport, **plan)
        self._t: NvshmemTransport = transport
        self._dev = transport.device
        self._counts = [len(f) for f in self._features_per_rank]
        self._group_sizes = list(group_sizes)
        self._weighted = weighted
        self._exact_always = not lookup_reads_only_bags
        self._me = transport.rank
        self._all = torch.arange(transport.world_size, dtype=torch.int32, device=self._dev)
        self._owners = torch.tensor(self._owners_with_tables, dtype=torch.int32, device=self._dev)
        self._group_first = [sum(self._group_sizes[:g]) for g in range(len(self._group_sizes))]
        self._expected_rows = 0
        self._my_batches: Deque[int] = collections.deque()
        # Owners store into one output block at their columns (table-wise), or each
        # into its own block of full rows (row-wise partial sums).
        self._out_blocks, self._my_out_block = 1, 0
        self._fused_lookup = fused_lookup
        self._tables_key: Tuple[int, ...] = ()
        self._tables = torch.empty(0, 4, dtype=torch.int64, device=self._dev)
        # The ids step whose slots a pending ``lookup_put`` still reads, or whose
        # launched ``lookup_put`` read until the step's ``output_take`` releases them.
        self._held: Optional[int] = None
        self._scratch: Dict[int, _SendScratch] = {}
        # A step's record (``DeviceRoute.record``): every source's header, then the
        # error record from this word on.
        self._err_at = transport.world_size * HEADER_WORDS

    # ----------------------------------------------------------------- set-up

    def _allocate(self, batch_size: int, offsets: torch.Tensor) -> None:
        """Sizes the buffers from the largest first batch of any rank (collective,
        and the one device-to-host sync of the set-up)."""
        self._t.reclaim()  # the buffers of models gone since the last allocation
        routed = [self._routed_features(w) for w in range(self._t.world_size)]
        self._runs = feature_runs(routed, self._dev)
        ids_per_owner = offsets.new_zeros(1)
        if batch_size:
            per_feature = offsets[batch_size::batch_size] - offsets[:-1:batch_size]
            ids_per_owner = torch.stack([per_feature[f].sum() for f in routed])
        sizes = torch.stack([torch.tensor(batch_size, device=self._dev), ids_per_owner.max()])
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self._t.group)
        batch, ids = sizes.tolist()
        self._layout = layout = IdsSlotLayout.for_batch(max(self._counts), batch, ids, self._headroom)
        t, world, depth = self._t, self._t.world_size, DEFAULT_DEPTH
        rows = layout.batch_capacity
        self._ids = t._tensor((depth * world * layout.nbytes,), torch.uint8)
        self._ids_ready = t._tensor((world,), torch.int64)
        self._ids_free = t._tensor((world,), torch.int64)
        self._out_slot = self._out_blocks * rows * self._dim_total * self._elem
        self._out = _Symmetric(t, (depth * self._out_slot,), torch.uint8)
        self._out_count = _Symmetric(t, (world,), torch.int64)
        self._out_free = t._tensor((world,), torch.int64)
        # An owner's slots of a step are [world * rows, its dims]: the generation is
        # sized by the widest owner.
        self._grad_generation = world * rows * max(self._dims) * self._elem
        self._grads = _Symmetric(t, (depth * self._grad_generation,), torch.uint8)
        self._grads_count = _Symmetric(t, (world,), torch.int64)
        self._grads_free = t._tensor((world,), torch.int64)
        self._done = done_counters(world, layout, self._dev)
        self._bag_scans: Dict[int, torch.Tensor] = {}
        # The lookup output of a step whose rows ``lookup_put`` put (none).
        self._no_rows = torch.empty(0, self._dims[self._me], dtype=self._out_dtype, device=self._dev)
        # Per-step constants, built once: every small tensor op is host time on the
        # critical path of a step.
        mine = self._my_out_block * rows * self._dim_total * self._elem
        self._out_addrs = [self._out.peers + g * self._out_slot + mine for g in range(depth)]
        self._my_counts = self._out_count.peers + self._me * 8
        self._no_chunks = torch.empty(world, 0, 3, dtype=torch.int64, device=self._dev)
        # Where this rank releases an owner's output slot and a source's ids slot.
        out_free, ids_free = t.peer_addresses(self._out_free).tolist(), t.peer_addresses(self._ids_free).tolist()
        word = 8 * self._me
        self._out_free_words = torch.tensor(
            [out_free[o] + word for o in self._owners_with_tables], dtype=torch.int64, device=self._dev
        )
        self._ids_free_words = torch.tensor([a + word for a in ids_free], dtype=torch.int64, device=self._dev)
        self._take_done = torch.zeros(1, dtype=torch.int64, device=self._dev)
        grads, counts = self._grads.peers.tolist(), self._grads_count.peers.tolist()
        self._grad_dests = torch.tensor(
            [
                [o, self._col_offsets[o], self._dims[o], grads[o] + self._me * rows * self._dims[o] * self._elem,
                 counts[o] + self._me * 8]
                for o in self._owners_with_tables
            ],
            dtype=torch.int64, device=self._dev,
        ).view(-1, 5)
        # torch divides by a scalar as a multiplication by its fp32 reciprocal.
        self._grad_scale = float(torch.tensor(1.0) / world)
        d = self._dims[self._me]
        self._grad_views = [
            self._grads.local[g * self._grad_generation : g * self._grad_generation + world * rows * d * self._elem]
            .view(self._out_dtype)
            .view(world * rows, d)
            for g in range(depth)
        ]
        # Each lookup group's first bag, and the end of the last group's bags.
        features = len(self._features_per_rank[self._me])
        self._group_bags = [f * world * rows for f in self._group_first + [features]]
        self._group_bags_dev = torch.tensor(self._group_bags, dtype=torch.int64, device=self._dev)
        self._slot_views = [
            self._ids[self._ids_slot_offset(0, g) : self._ids_slot_offset(world, g)] for g in range(depth)
        ]
        self._out_views = [
            self._out.local[g * self._out_slot : (g + 1) * self._out_slot]
            .view(self._out_dtype)
            .view(self._out_blocks, rows, self._dim_total)
            for g in range(depth)
        ]
        # When the model goes, its buffers go back to the transport.
        symmetric = [self._ids, self._ids_ready, self._ids_free, self._out.local, self._out_count.local,
                     self._out_free, self._grads.local, self._grads_count.local, self._grads_free]
        weakref.finalize(self, t.retire, t.owner_id(), symmetric)
        torch.cuda.synchronize(self._dev)
        t.barrier()

    def _ids_slot_offset(self, source: int, step: int) -> int:
        assert self._layout is not None
        return ((step % DEFAULT_DEPTH) * self._t.world_size + source) * self._layout.nbytes

    # ------------------------------------------------------------ ids forward

    def send_ids(self, kjt: KeyedJaggedTensor) -> int:
        """Puts this rank's ids for the next step into every owner's slot; returns the
        step."""
        batch = kjt.stride()
        values, weights = kjt.values(), kjt.weights_or_none()
        problem: Optional[Tuple[Status, Tuple[int, ...]]] = None
        host_problem = self._host_problem(kjt)
        if host_problem is not None:
            status, detail, batch = host_problem
            problem = (status, detail)
        elif self._weighted and weights is None:
            # The kernels would read weights the slots do not hold.
            problem = (Status.BAD_DTYPE, (BadDtype.NO_WEIGHTS,))
        else:
            # The kernels read raw pointers: dense tensors of the slots' dtypes.
            values = values.to(torch.int64).contiguous()
            weights = weights.to(torch.float32).contiguous() if weights is not None else None
        lengths, offsets = kjt.lengths().contiguous(), kjt.offsets().contiguous()
        checked = (values, offsets, lengths)
        # Slots hold int32 lengths; ids_check narrows wider ones as it checks them.
        narrowed = None
        if lengths.dtype != torch.int32:
            if problem is None:
                lengths = narrowed = torch.empty(lengths.numel(), dtype=torch.int32, device=self._dev)
            else:
                lengths = lengths.to(torch.int32)
        if problem is None:
            values, offsets, lengths, weights = self._route(kjt, values, offsets, lengths, weights)
        else:
            offsets, lengths = self._unrouted(offsets, lengths)
        if self._layout is None:
            self._allocate(batch, offsets)
        layout = self._layout
        assert layout is not None
        # A pipeline may send the next batch before this one's lookup; only a send that
        # reuses the held slots' generation means the lookup is not coming.
        if self._held is not None and self._send_step + 1 - self._held >= DEFAULT_DEPTH:
            self._release_held()
        self._make_room()
        self._send_step += 1
        step = self._send_step
        verdict, headers, chunks = self._send_scratch()
        if problem is None:
            ids_check(*checked, self._num_rows, verdict, batch, narrowed)
        ids_header(
            verdict, values, offsets, lengths, weights, self._num_rows, self._runs,
            headers, chunks, batch, problem, layout, self._ids_slot_offset(self._me, step),
            checked=checked[:2],
        )
        put_signal(
            self._all, chunks, self._ids, self._ids_ready, self._ids_free, self._t.err,
            self._me, step, max(step - DEFAULT_DEPTH, 0), self._t.timeout_ns,
        )
        self._my_batches.append(batch if batch <= layout.batch_capacity else 0)
        return step

    def _send_scratch(self) -> "_SendScratch":
        """The current stream's buffers for a send: each send's kernels are done with
        them before the next send's on the stream start (one allocation per stream, not
        per send; sends may come from several streams, such as a training and an
        evaluation pipeline). The ``ids_header`` of the stream's last send left the
        verdict at ``NONE``."""
        stream = driver.active.get_current_stream(self._dev.index)
        scratch = self._scratch.get(stream)
        if scratch is None:
            world, chunks = self._t.world_size, 3 * self._runs.size(1) + 1
            scratch = self._scratch[stream] = _SendScratch(
                verdict=torch.full((2,), NONE, dtype=torch.int64, device=self._dev),
                headers=torch.empty(world, HEADER_WORDS, dtype=torch.int64, device=self._dev),
                chunks=torch.empty(world, chunks, 3, dtype=torch.int64, device=self._dev),
            )
        return scratch

    def _route(
        self, kjt: KeyedJaggedTensor, values: torch.Tensor, offsets: torch.Tensor,
        lengths: torch.Tensor, weights: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The batch as it is routed, each owner's features contiguous (table-wise:
        already so, TorchRec orders the sharding's features by rank); the checks run on
        ``kjt`` as given."""
        return values, offsets, lengths, weights

    def _routable(self, pos: List[int]) -> bool:
        return all(len(runs_of(part)) <= MAX_RUNS for part in _per_owner(self._counts, pos))

    def _routed_features(self, owner: int) -> List[int]:
        """Where owner ``owner``'s features, in the order its lookup takes them, are in
        the routed batch (table-wise: the batch as given, in the sharding's order or in
        the one ``adopt_input_order`` took)."""
        return _per_owner(self._counts, self._input_pos)[owner]

    def _unrouted(self, offsets: torch.Tensor, lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Offsets and lengths in the routed layout for a batch that is not routed (it
        goes as a bare header; only sizes are read from it)."""
        return offsets, lengths

    def _drop_next(self) -> None:
        self._recv_step += 1
        step = self._recv_step
        self._wait(self._ids_ready, self._all, arrived(step))
        self._signal(self._all, self._ids_free, step)
        self._my_batches.popleft()

    def recv_ids(self, step: int) -> LookupBatch:
        """Enqueues the wait for every source's slot of ``step`` and lays out the
        owner's lookup batch (see the module docstring)."""
        layout = self._layout
        assert layout is not None, "recv_ids before send_ids"
        self._release_held()
        self._catch_up(step)
        self._recv_step = step
        world, cap = self._t.world_size, layout.batch_capacity
        slots = self._slot_views[step % DEFAULT_DEPTH]
        record = torch.empty(self._err_at + self._t.err.numel(), dtype=torch.int64, device=self._dev)
        features = len(self._features_per_rank[self._me])
        # One scan state per stream: receives may come from several (pipelines).
        stream = driver.active.get_current_stream(self._dev.index)
        scan = self._bag_scans.get(stream)
        if scan is None:
            scan = self._bag_scans[stream] = scan_state(features, world, layout, self._dev)
        offsets = bag_offsets(
            slots, features, layout, record, scan, self._ids_ready, arrived(step), self._t.err, self._t.timeout_ns
        )
        batch = LookupBatch(groups=[], record=record, bags_per_feature=world * cap)
        route = DeviceRoute(record=record, my_batch=self._my_batches.popleft())
        if features:
            if self._fused_lookup and not torch.is_grad_enabled():
                # The lookup pools straight from the slots: they stay held until then.
                self._held = step
                batch.pending = lambda b, modules: self._lookup_put(b, modules, route, slots, offsets, step, stream)
                return attach_route(batch, route)
            batch.groups = self._groups(slots, offsets)
        # Everything is read (stream ordered): release the slots to their sources.
        self._signal(self._all, self._ids_free, step)
        return attach_route(batch, route)

    def _groups(self, slots: torch.Tensor, offsets: torch.Tensor) -> List[KeyedJaggedTensor]:
        """The lookup groups' KJTs of a step, gathered from its slots."""
        layout = self._layout
        assert layout is not None
        world, cap = self._t.world_size, layout.batch_capacity
        features = self._features_per_rank[self._me]
        bags = self._group_bags
        # FBGEMM's backward sorts the whole index tensor: under autograd it must
        # hold exactly the batch's ids, the one size this rank then reads back.
        exact = self._exact_always or torch.is_grad_enabled()
        if exact:
            at = offsets.index_select(0, self._group_bags_dev).tolist()
        groups = []
        for g, (first, size) in enumerate(zip(self._group_first, self._group_sizes)):
            lo, hi = bags[g], bags[g + 1]
            g_offsets = offsets if len(bags) == 2 else offsets[lo : hi + 1] - offsets[lo]
            n = at[g + 1] - at[g] if exact else world * layout.ids_capacity
            indices = torch.empty(n, dtype=torch.int64, device=self._dev)
            weights = torch.empty(n if self._weighted else 1, dtype=torch.float32, device=self._dev)
            gather_ids(slots, offsets, indices, weights, first, size, layout, self._weighted)
            groups.append(
                KeyedJaggedTensor(
                    keys=[x.name for x in features[first : first + size]],
                    values=indices,
                    offsets=g_offsets,
                    weights=weights if self._weighted else None,
                    stride=world * cap,
                )
            )
        return groups

    def _release_held(self) -> None:
        """Releases the slots of a step whose lookup, or whose output, will not come (a
        dropped batch)."""
        if self._held is not None:
            self._signal(self._all, self._ids_free, self._held)
            self._held = None

    def _lookup_put(
        self, batch: LookupBatch, emb_modules: Sequence[Any], route: DeviceRoute,
        slots: torch.Tensor, offsets: torch.Tensor, step: int, stream: int,
    ) -> Optional[torch.Tensor]:
        """Pools every requester's bags from the slots of ``step`` and puts the rows
        (``kernels/lookup_put``; ``exchange_pooled`` releases the slots); or, under
        autograd or for tables it cannot read, fills ``batch.groups`` for TorchRec's
        lookup and releases the slots."""
        if self._held != step:
            raise PgasError(
                f"{self._name}: rank {self._me} looked up a batch whose ids were released "
                f"(later batches were received, or {DEFAULT_DEPTH} were sent, before its lookup)"
            )
        if driver.active.get_current_stream(self._dev.index) != stream:
            # A pipeline lays the batch out on its data-dist stream; the lookup runs on this one.
            offsets.record_stream(torch.cuda.current_stream(self._dev))
        tables = None if torch.is_grad_enabled() else self._table_rows(emb_modules)
        if tables is None:
            batch.groups = self._groups(slots, offsets)
            out = None
        else:
            layout = self._layout
            assert layout is not None
            out_step = self._next_out_step()
            lookup_put(
                slots, offsets, tables, emb_modules[0].emb_module.weights_dev,
                self._out_views[0], self._out_addrs[out_step % DEFAULT_DEPTH], self._my_counts,
                self._done, self._out_free, self._t.err, layout, self._dim_total, self._weighted,
                max(out_step - DEFAULT_DEPTH, 0), self._t.timeout_ns,
            )
            # The slots stay held until the output's take releases them.
            route.ids_step = step
            return self._no_rows.detach()  # a tensor of its own: it carries the step's route
        self._held = None
        self._signal(self._all, self._ids_free, step)
        return out

    def _table_rows(self, emb_modules: Sequence[Any]) -> Optional[torch.Tensor]:
        """``lookup_put``'s feature table for these lookup modules, or None if some
        table is not wholly in device memory (the kernel reads only ``weights_dev``),
        the groups' weights differ in dtype (one launch reads one dtype), or are
        quantized (rows with scale and bias, which the kernel does not read)."""
        tbes = [m.emb_module for m in emb_modules]
        key = tuple(t.weights_dev.data_ptr() for t in tbes)
        if key == self._tables_key:
            return self._tables
        dtypes = {t.weights_dev.dtype for t in tbes}
        if any(t.weights_uvm.numel() or t.weights_host.numel() for t in tbes) or len(dtypes) > 1 or not dtypes <= _FLOATS:
            self._fused_lookup = False
            return None
        rows, col = [], self._col_offsets[self._me]
        for t in tbes:
            w, dims, at = t.weights_dev, t.D_offsets.tolist(), t.weights_offsets.tolist()
            mean = int(t.pooling_mode == PoolingMode.MEAN)
            rows += [[w.data_ptr() + at[f] * w.element_size(), dims[f + 1] - dims[f], col + dims[f], mean] for f in range(len(dims) - 1)]
            col += dims[-1]
        self._tables_key = key
        self._tables = torch.tensor(rows, dtype=torch.int64, device=self._dev)
        return self._tables

    def _wait(self, sig: torch.Tensor, peers: torch.Tensor, target: int) -> None:
        """Enqueues a wait for data: ``sig[q] >= target`` for every ``q`` in ``peers``."""
        signal_wait(sig, peers, target, self._t.err, _WAIT_DATA, self._t.timeout_ns)

    def _signal(self, peers: torch.Tensor, sig: torch.Tensor, step: int) -> None:
        """Sets word ``me`` of ``sig`` at every peer to ``step``."""
        put_signal(
            peers, self._no_chunks,
            self._ids, sig, sig, self._t.err, self._me, step, 0, self._t.timeout_ns,
        )

    # ---------------------------------------------------------- pooled forward

    def _next_out_step(self) -> int:
        self._out_step += 1
        return self._out_step

    def exchange_pooled(self, local_embs: torch.Tensor, route: DeviceRoute) -> torch.Tensor:
        """Puts every requester's rows (unless ``lookup_put`` did); returns this rank's
        output (see module doc)."""
        layout = self._layout
        assert layout is not None
        me = self._me
        if route.ids_step:
            step = self._out_step
        else:
            step = self._next_out_step()
            if self._dims[me] > 0:
                rows_put(
                    local_embs.detach().to(self._out_dtype).contiguous(),
                    route.record[1 : self._err_at : HEADER_WORDS],
                    self._out_addrs[step % DEFAULT_DEPTH],
                    self._my_counts,
                    self._out_free, self._t.err, layout.batch_capacity, self._dim_total,
                    self._col_offsets[me], max(step - DEFAULT_DEPTH, 0), self._t.timeout_ns,
                )
        ids_step = route.ids_step if route.ids_step == self._held else 0  # (not released since)
        if ids_step:
            self._held = None
        self._expected_rows += programs_per_requester(route.my_batch)
        # A copy: the slot is reused two steps on, the output may live longer.
        out = torch.empty(route.my_batch, self._dim_total, dtype=self._out_dtype, device=self._dev)
        output_take(
            self._out_views[step % DEFAULT_DEPTH], out, self._out_count.local, self._owners,
            self._out_free_words, self._ids_free_words, self._take_done, self._t.err, route.record,
            self._err_at, self._expected_rows, step, ids_step, self._t.timeout_ns,
        )
        self._check(route.record)
        return out

    def _check(self, step_record: torch.Tensor) -> None:
        """Raises what the step's headers or the device-side waits report (one sync)."""
        record = step_record.tolist()
        n = HEADER_WORDS
        if record[self._err_at]:  # the error record's code word
            self._t.check(self._name)
        self._raise_for_bad_headers(
            [Header.decode(record[n * s : n * s + n]) for s in range(self._t.world_size)],
            self._out_step,
        )

    # ---------------------------------------------------------------- backward

    def exchange_grads(
        self, grad_out: torch.Tensor, route: DeviceRoute, local_embs_shape: torch.Size, divide: bool
    ) -> torch.Tensor:
        """Puts each owner's columns of ``grad_out`` (divided by the world size if
        ``divide``); returns the gradient of the local pooled embeddings in the lookup's
        (padded) row order."""
        layout = self._layout
        assert layout is not None
        self._grad_step += 1
        step = self._grad_step
        cap = layout.batch_capacity
        generation = (step % DEFAULT_DEPTH) * self._grad_generation
        grads_put(
            grad_out.to(self._out_dtype).contiguous(), self._grad_dests, self._grads_free, self._t.err,
            cap, generation, self._grad_scale if divide else 1.0, max(step - DEFAULT_DEPTH, 0),
            self._t.timeout_ns,
        )
        if self._dims[self._me] == 0:
            return grad_out.new_zeros(local_embs_shape)
        if step > 1:
            # The previous step's slots: FBGEMM's backward read them, and it is ordered
            # before this (the same stream, or, for a lookup on a stream of its own,
            # through this step's forward, whose output dist waited for its lookup).
            self._signal(self._all, self._grads_free, step - 1)
        self._wait(self._grads_count.local, self._all, step * programs_per_source(cap))
        # A view of the slots, valid until the next backward releases them. Rows past a
        # source's batch belong to empty bags: FBGEMM's backward never reads them.
        return self._grad_views[step % DEFAULT_DEPTH]
