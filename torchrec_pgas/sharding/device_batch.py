"""The GPU exchange's per-step objects: the lookup batch an owner receives, the route
a step's output and gradient exchanges need, and what builds them from the ids slots
(``LookupGroups``, ``FusedTables``, ``StreamScratch``)."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.bag_offsets import scan_state
from torchrec_pgas.kernels.gather_ids import gather_ids
from torchrec_pgas.kernels.ids_check import NONE
from torchrec_pgas.kernels.ids_slot import HEADER_WORDS, BadDtype, Header, IdsSlotLayout, Status
from torchrec_pgas.kernels.put_signal import PROGRAMS_PER_PEER
from torchrec_pgas.sharding.device_routing import IdsRouting
from torchrec_pgas.sharding.tw_base import TwFeature

_FLOATS = {torch.float32, torch.float16, torch.bfloat16}
#: What ``failure_texts`` gives for a message a later send overwrote.
_OVERWRITTEN = "(its message was overwritten by a later send: see that rank)"


@dataclass
class DeviceRoute:
    """What the output and gradient exchanges of a step need from its input."""

    # int64 [S * 8 + 5], on the device: every source's header of the step, then the
    # error record once the step's output has arrived, then the ids step (which the
    # step's kernels read: ``kernels/step_clock.py``).
    record: torch.Tensor
    my_batch: int  # this rank's batch size as its header reports it (owners store that many rows)
    out_rows: int  # the rows of this rank's output (a bad batch's own size: ``_output_rows``)
    # The rows were put by ``lookup_put``, pooled straight from the ids slots of this
    # step, which go back to their sources with the output's slot (0: not so).
    ids_step: int = 0
    step: int = 0  # the ids step the route is of
    divisor: Optional[torch.Tensor] = None  # row-wise mean pooling: [batch, dims]
    # The step is checked before its output is returned (training with FBGEMM's
    # backward, which must not apply a bad step: set by the receive and the lookup, in
    # grad mode, since autograd runs the output exchange without it); else later, from
    # the step records (``step_records.py``).
    check_now: bool = False
    # This rank's output, where the lookup stored its own rows (``lookup_put``), with
    # the stream it was allocated on (a raw handle); else the output exchange makes it.
    out: Optional[torch.Tensor] = None
    out_stream: int = 0
    # Where the module wants this rank's output (``StepRoute``): the lookup and the
    # output exchange store it there instead of allocating it.
    dest: Optional[torch.Tensor] = None
    # World size 1 with the fused update: the update reads the output's gradient as it
    # is (the one gradient slot would hold a copy of it), and the lookup output is
    # ``out_rows`` rows, not the slots' ``world * batch_capacity``.
    grads_in_place: bool = False


@dataclass
class SlotsLookup:
    """What a lookup that pools straight from a step's ids slots reads (inference;
    ``DeviceTwExchange.lookup_put``; the step's record says which slots). The slots
    stay held until then."""

    offsets: torch.Tensor  # int64: the bags' offsets in the slots (``bag_offsets``)
    ids_step: torch.Tensor  # int64 [1]: the ids step on the device (the record's word)
    step: int  # the ids step
    stream: int  # the stream the batch was laid out on (a raw handle)


@dataclass
class LookupBatch:
    """The owner's lookup input of one step (a ``LookupInput``): per lookup group, the
    bag offsets and ids (and weights) of ``bags_per_feature`` bags per feature, and
    the step's route.

    Without autograd the groups are left empty at first, and ``from_slots`` says what
    the exchange's ``lookup_put`` reads (once): it then pools the bags straight from
    the slots and puts the rows, or fills the groups for TorchRec's lookup."""

    groups: List[Any]  # KeyedJaggedTensors, or GroupIds (``LookupGroups.tensors``)
    route: DeviceRoute
    bags_per_feature: int
    from_slots: Optional[SlotsLookup] = None

    # TorchRec inspects the input dist's output as a KJT in a few places.
    def variable_stride_per_key(self) -> bool:
        return False

    def stride(self) -> int:
        return self.bags_per_feature

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for group in self.groups:
            group.record_stream(stream)
        self.route.record.record_stream(stream)
        if self.route.divisor is not None:  # row-wise mean: divides the output on that stream
            self.route.divisor.record_stream(stream)


class SendInput(NamedTuple):
    """A batch as a send's kernels take it."""

    batch: int  # the batch size its header reports
    problem: Optional[Tuple[Status, Tuple[int, ...]]]  # sent as a bare header if set
    # Routed to the owners; with a problem, unrouted and only sizes are read.
    values: torch.Tensor  # int64 ids (as given with a problem)
    offsets: torch.Tensor
    lengths: torch.Tensor  # int32 (``narrowed`` until ``ids_check`` wrote it)
    weights: Optional[torch.Tensor]  # float32
    checked: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # values, offsets, lengths as given
    narrowed: Optional[torch.Tensor]  # int32 [lengths]: ``ids_check`` narrows wider lengths into it


def send_input(
    kjt: KeyedJaggedTensor,
    host_problem: Optional[Tuple[Status, Tuple[int, ...], int]],
    weighted: bool,
    routing: IdsRouting,
    device: torch.device,
    narrowed_out: Optional[Callable[[int], torch.Tensor]] = None,
) -> SendInput:
    """``kjt`` for a send: ``host_problem`` is what the host sees wrong with it
    (``BaseTwExchange._host_problem``), ``routing`` routes its ids to their owners.
    ``narrowed_out(n)``: the int32 ``[n]`` tensor ``ids_check`` narrows wider lengths
    into (default: a new one)."""
    batch = kjt.stride()
    values, weights = kjt.values(), kjt.weights_or_none()
    problem: Optional[Tuple[Status, Tuple[int, ...]]] = None
    if host_problem is not None:
        status, detail, batch = host_problem
        problem = (status, detail)
    elif weighted and weights is None:
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
            n = lengths.numel()
            narrowed = narrowed_out(n) if narrowed_out is not None else None
            lengths = narrowed = narrowed if narrowed is not None else torch.empty(n, dtype=torch.int32, device=device)
        else:
            lengths = lengths.to(torch.int32)
    if problem is None:
        values, offsets, lengths, weights = routing.route(kjt, values, offsets, lengths, weights)
    else:
        offsets, lengths = routing.unrouted(offsets, lengths)
    return SendInput(batch, problem, values, offsets, lengths, weights, checked, narrowed)


def put_text(chunks: torch.Tensor, text: torch.Tensor) -> None:
    """Makes the first chunk of every owner's put in ``chunks`` (``ids_header``'s: the
    lengths of a batch, which a ``Status.FAILED`` send has none of) carry ``text``
    (uint8, on the device, alive until the puts are done) right after the header,
    where ``failure_texts`` reads it. Only a failing send comes here."""
    chunks[:, 0, 1] = text.data_ptr()
    chunks[:, 0, 2] = text.numel()


def failure_texts(headers: Sequence[Header], slots: torch.Tensor, layout: IdsSlotLayout) -> List[str]:
    """The messages of the ``Status.FAILED`` slots among a step's ``slots`` (every
    source's, as received, with its ``headers``). The slots were given back at the
    receive, and a source may have sent into them since, even while the text is read:
    a text counts only if the slot's header is the step's both before and after it."""
    texts = []
    for h, slot in zip(headers, slots.view(len(headers), -1)):
        text = ""
        if h.status == Status.FAILED:
            text = _OVERWRITTEN
            if layout.header(slot) == h:
                read = layout.text(slot, h.detail[0])
                if layout.header(slot) == h:
                    text = read
        texts.append(text)
    return texts


class SendScratch(NamedTuple):
    verdict: torch.Tensor  # int64 [2], see ``ids_check``
    headers: torch.Tensor  # int64 [W, 8], see ``ids_header``
    chunks: torch.Tensor  # int64 [W, 3R + 1, 3], see ``ids_header``
    put_done: torch.Tensor  # int64 [PROGRAMS_PER_PEER], zero: ``put_signal``'s ``done``


class StreamScratch:
    """Device scratch of sends and receives, one per stream: each send's (receive's)
    kernels are done with it before the next one's on the stream start (one
    allocation per stream, not per step; steps may come from several streams, such as
    a training and an evaluation pipeline). ``runs``: ``feature_runs``' table;
    ``input_features``: the features of the batches sent."""

    def __init__(
        self,
        runs: torch.Tensor,
        features: int,
        layout: IdsSlotLayout,
        world: int,
        device: torch.device,
        input_features: int = 1,
    ):
        self._runs, self._features, self._layout = runs, features, layout
        self._world, self._dev = world, device
        # The lengths of a batch of ``input_features`` features within capacity.
        self._lengths = input_features * layout.batch_capacity
        self._sends: Dict[int, SendScratch] = {}
        self._scans: Dict[int, torch.Tensor] = {}
        # Per stream: its narrowed lengths' tensor, and its last view.
        self._narrowed: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def send(self, stream: int) -> SendScratch:
        """The stream's buffers for a send. The ``ids_header`` of the stream's last
        send left the verdict at ``NONE``."""
        scratch = self._sends.get(stream)
        if scratch is None:
            world, chunks = self._world, 3 * self._runs.size(1) + 1
            scratch = self._sends[stream] = SendScratch(
                verdict=torch.full((2,), NONE, dtype=torch.int64, device=self._dev),
                headers=torch.empty(world, HEADER_WORDS, dtype=torch.int64, device=self._dev),
                chunks=torch.empty(world, chunks, 3, dtype=torch.int64, device=self._dev),
                put_done=torch.zeros(PROGRAMS_PER_PEER, dtype=torch.int64, device=self._dev),
            )
        return scratch

    def narrowed(self, stream: int, n: int) -> torch.Tensor:
        """int32 ``[n]``: the stream's tensor a send's ``ids_check`` narrows wider
        lengths into (``send_input``), read by that send's puts, which are done before
        the stream's next send starts."""
        whole, view = self._narrowed.get(stream, (None, None))
        if view is not None and view.numel() == n:
            return view
        if n > self._lengths:
            # A batch over capacity (its step raises) gets a tensor of its own: the
            # stream's keeps its address, which a captured graph may hold.
            return torch.empty(n, dtype=torch.int32, device=self._dev)
        if whole is None:
            whole = torch.empty(self._lengths, dtype=torch.int32, device=self._dev)
        view = whole[:n]
        self._narrowed[stream] = (whole, view)
        return view

    def scan(self, stream: int) -> torch.Tensor:
        """The stream's ``bag_offsets`` scan state."""
        scan = self._scans.get(stream)
        if scan is None:
            scan = self._scans[stream] = scan_state(self._features, self._world, self._layout, self._dev)
        return scan


class GroupIds:
    """One lookup group of a step as the tensors FBGEMM's lookup takes, read as a KJT's
    (``values``, ``offsets``, ``weights``): for an owner that calls FBGEMM's operator
    itself (the quantized module), without a KJT built per group and step."""

    __slots__ = ("_values", "_offsets", "_weights")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
        self._values, self._offsets, self._weights = values, offsets, weights

    def values(self) -> torch.Tensor:
        return self._values

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def weights(self) -> torch.Tensor:
        assert self._weights is not None, "an unweighted lookup group has no weights"
        return self._weights

    def weights_or_none(self) -> Optional[torch.Tensor]:
        return self._weights

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in (self._values, self._offsets, self._weights):
            if t is not None:
                t.record_stream(stream)


class LookupGroups:
    """Lays a step's ids out as the owner's lookup groups (``gather_ids``): KJTs for
    TorchRec's lookup (``kjts``), or tensors for an owner that calls FBGEMM itself
    (``tensors``).

    Args:
        features: the owner's features, in lookup order.
        group_sizes: the number of features of each lookup group, in lookup order.
        weighted: whether the slots hold weights the lookup reads.
        exact_always: whether the index tensor must hold exactly the batch's ids even
            without autograd (else it has the slots' capacity and FBGEMM reads only
            what the offsets cover).
    """

    def __init__(
        self,
        features: Sequence[TwFeature],
        group_sizes: Sequence[int],
        weighted: bool,
        exact_always: bool,
        layout: IdsSlotLayout,
        world: int,
        device: torch.device,
    ) -> None:
        self._features, self._sizes = list(features), list(group_sizes)
        self._first = [sum(self._sizes[:g]) for g in range(len(self._sizes))]
        self._weighted, self._exact_always = weighted, exact_always
        self._layout, self._world, self._dev = layout, world, device
        # Each lookup group's first bag, and the end of the last group's bags.
        rows = layout.batch_capacity
        self._bags = [f * world * rows for f in self._first + [len(self._features)]]
        self._bags_dev = torch.tensor(self._bags, dtype=torch.int64, device=device)
        self._keys = [[x.name for x in self._features[f : f + n]] for f, n in zip(self._first, self._sizes)]
        # What an unweighted gather is given for the weights it does not write.
        self._no_weights = torch.empty(1, dtype=torch.float32, device=device)
        # ``tensors``' index (and weights) tensors of the slots' capacity, per stream.
        self._reused: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}

    def kjts(
        self,
        ids: torch.Tensor,
        step: torch.Tensor,
        offsets: torch.Tensor,
        exact: bool,
        for_update: bool = False,
        ids_dtype: torch.dtype = torch.int64,
    ) -> List[KeyedJaggedTensor]:
        """The lookup groups' KJTs of a step, gathered from its slots (in ``ids``, the
        mailbox, at the generation of the step in ``step``, an int64 word). FBGEMM's
        backward sorts the whole index tensor: for it (``exact``), the tensor holds
        exactly the batch's ids, the one size this rank then reads back; else it has
        the slots' capacity, which FBGEMM's lookup reads only as far as the offsets
        say unless it reads past the bags (then always exact), and the fused update
        (``for_update``, whose ids may be ``ids_dtype``) never does."""
        exact = exact or (self._exact_always and not for_update)
        stride = self._world * self._layout.batch_capacity
        groups = self._gather(ids, step, offsets, exact, None, ids_dtype if for_update else torch.int64)
        return [
            KeyedJaggedTensor(keys=keys, values=indices, offsets=g_offsets, weights=weights, stride=stride)
            for keys, (indices, g_offsets, weights) in zip(self._keys, groups)
        ]

    def tensors(self, ids: torch.Tensor, step: torch.Tensor, offsets: torch.Tensor, stream: int) -> List[GroupIds]:
        """``kjts(..., exact=False)`` as ``GroupIds``, for a lookup that runs on
        ``stream`` (the receive's, a raw handle) before the stream's next receive:
        unless the lookup reads past the bags (``exact_always``), each group's index
        tensor is then the stream's own, the same at every step."""
        exact = self._exact_always
        groups = self._gather(ids, step, offsets, exact, None if exact else stream, torch.int64)
        return [GroupIds(*group) for group in groups]

    def _gather(
        self,
        ids: torch.Tensor,
        step: torch.Tensor,
        offsets: torch.Tensor,
        exact: bool,
        stream: Optional[int],
        ids_dtype: torch.dtype,
    ) -> List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """Per group, its ids (``ids_dtype``), offsets and weights (None if unweighted)
        of a step (see ``kjts``); the index tensors are ``stream``'s own if given (not
        ``exact``; then int64)."""
        layout, world, bags = self._layout, self._world, self._bags
        if exact:
            at = offsets.index_select(0, self._bags_dev).tolist()
        reused = self._reused.get(stream) if stream is not None else None
        if stream is not None and reused is None:
            n = world * layout.ids_capacity
            reused = self._reused[stream] = [self._outputs(n, torch.int64) for _ in self._sizes]
        groups = []
        for g, (first, size) in enumerate(zip(self._first, self._sizes)):
            lo, hi = bags[g], bags[g + 1]
            g_offsets = offsets if len(bags) == 2 else offsets[lo : hi + 1] - offsets[lo]
            if reused is not None:
                indices, weights = reused[g]
            else:
                indices, weights = self._outputs(at[g + 1] - at[g] if exact else world * layout.ids_capacity, ids_dtype)
            gather_ids(ids, step, world, offsets, indices, weights, first, size, layout, self._weighted)
            groups.append((indices, g_offsets, weights if self._weighted else None))
        return groups

    def _outputs(self, n: int, ids_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """A gather's index tensor of ``n`` ids, and its weights (``_no_weights`` if
        unweighted)."""
        indices = torch.empty(n, dtype=ids_dtype, device=self._dev)
        if not self._weighted:
            return indices, self._no_weights
        return indices, torch.empty(n, dtype=torch.float32, device=self._dev)


class FusedTables:
    """``lookup_put``'s feature table for the owner's lookup modules: per feature, the
    address of its table's rows, its dim, its first output column and whether it pools
    by mean (int64 [features, 4]); built once per set of tables. ``enabled`` goes
    False for good when the tables cannot be read (see ``rows``)."""

    def __init__(self, enabled: bool, first_col: int, device: torch.device) -> None:
        self.enabled = enabled
        self._first_col, self._dev = first_col, device
        self._key: tuple = ()
        self._rows = torch.empty(0, 4, dtype=torch.int64, device=device)

    def rows(self, emb_modules: Sequence[Any]) -> Optional[torch.Tensor]:
        """The table, or None if some table is not wholly in device memory (the kernel
        reads only ``weights_dev``), the groups' weights differ in dtype (one launch
        reads one dtype), or are quantized (rows with scale and bias, which the kernel
        does not read)."""
        tbes = [m.emb_module for m in emb_modules]
        key = tuple(t.weights_dev.data_ptr() for t in tbes)
        if key == self._key:
            return self._rows
        dtypes = {t.weights_dev.dtype for t in tbes}
        off_device = any(t.weights_uvm.numel() or t.weights_host.numel() for t in tbes)
        if off_device or len(dtypes) > 1 or not dtypes <= _FLOATS:
            self.enabled = False
            return None
        rows, col = [], self._first_col
        for t in tbes:
            w, dims, at = t.weights_dev, t.D_offsets.tolist(), t.weights_offsets.tolist()
            mean = int(t.pooling_mode == PoolingMode.MEAN)
            rows += [
                [w.data_ptr() + at[f] * w.element_size(), dims[f + 1] - dims[f], col + dims[f], mean]
                for f in range(len(dims) - 1)
            ]
            col += dims[-1]
        self._key = key
        self._rows = torch.tensor(rows, dtype=torch.int64, device=self._dev)
        return self._rows
