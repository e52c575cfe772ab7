"""What every table-wise exchange knows from the plan, whatever moves its data."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from torchrec_pgas.kernels.ids_slot import BadDtype, Capacity, Header, IdsSlotLayout, Status, describe
from torchrec_pgas.transport import PgasError, Transport
from torchrec_pgas.transport.mailbox import DEFAULT_DEPTH

if TYPE_CHECKING:
    from torchrec_pgas.sharding.exchange import LookupInput
    from torchrec_pgas.sharding.mean_after_sum import MeanAfterSum


class PgasInputError(PgasError, ValueError):
    """A rank fed a batch that cannot be served; raised on every rank."""


@dataclass(frozen=True)
class TwFeature:
    """A feature as the table-wise plan places it."""

    name: str
    table: str
    num_embeddings: int


class InputRouting(Protocol):
    """What ``BaseTwExchange.adopt_input_order`` asks of an exchange's ids routing
    (``host_routing.HostIdsRouting``, ``device_routing.IdsRouting``)."""

    def routable(self, input_pos: Sequence[int], num_keys: Optional[int] = None) -> bool:
        """Whether batches of ``num_keys`` features (default ``len(input_pos)``) in
        which the sharding's input feature ``i`` is at ``input_pos[i]`` can be routed."""


class BaseTwExchange:
    """Plan-derived state and step bookkeeping shared by the host and GPU exchanges.

    Args:
        transport: one-sided transport over the sharding's process group.
        features_per_rank: the features each rank owns, in the sharding's order.
        dim_sum_per_rank: the total embedding dim of the tables each rank owns.
        out_dtype: dtype of the pooled embeddings (the lookup's output dtype).
        capacity: how the slots are sized from the first batch (``PgasOptions``).
        name: prefix of error messages.
        input_features: the features of the batches the input dist is given, with the
            rows their ids index (default: ``features_per_rank`` flattened).
        out_dim: the columns of a rank's pooled output (default: the sum of
            ``dim_sum_per_rank``, each owner's tables side by side; row-wise: every
            owner covers every column).
        mean: the mean pooling applied after the owners' partial sums are added
            (row-wise), if any.

    Subclasses implement a step as ``_send``, ``_recv`` and ``_drop_step``; the
    public ``send_ids``, ``recv_ids`` and ``_drop_next`` keep the bookkeeping that is
    the same for every exchange. They set ``_routing``, which ``adopt_input_order``
    asks.
    """

    _routing: InputRouting

    def __init__(
        self,
        transport: Transport,
        features_per_rank: Sequence[Sequence[TwFeature]],
        dim_sum_per_rank: Sequence[int],
        out_dtype: torch.dtype,
        capacity: Capacity,
        name: str,
        input_features: Optional[Sequence[TwFeature]] = None,
        out_dim: Optional[int] = None,
        mean: Optional["MeanAfterSum"] = None,
    ) -> None:
        self._t = transport
        self._features_per_rank = [list(f) for f in features_per_rank]
        self._features = [f for fs in self._features_per_rank for f in fs]
        # The features of the batches the input dist is given, in their order: the
        # sharding's own until ``adopt_input_order``.
        self._sharding_features = list(input_features or self._features)
        self._set_input_features(self._sharding_features)
        # Where each of the sharding's input features sits in those batches.
        self._input_pos = list(range(len(self._input_features)))
        self._reordered = False
        self._dims = list(dim_sum_per_rank)
        self._col_offsets = [sum(self._dims[:r]) for r in range(len(self._dims))]
        self._dim_total = out_dim if out_dim is not None else sum(self._dims)
        self._mean = mean
        self._out_dtype = out_dtype
        self._elem = torch.empty((), dtype=out_dtype).element_size()
        self._capacity = capacity
        self._name = name
        self._owners_with_tables = [r for r, d in enumerate(self._dims) if d > 0]
        self._layout: Optional[IdsSlotLayout] = None
        self._send_step = self._recv_step = self._out_step = self._grad_step = 0
        self._reported: Optional[Tuple[Status, Tuple[int, ...]]] = None
        # A message to send with ``Status.FAILED`` (the next send's), and this rank's
        # error behind the last one sent, raised as the cause on this rank.
        self._failure: Optional[str] = None
        self._sending = ""
        self._failure_cause: Optional[BaseException] = None
        # The error of a set-up (buffers) that failed: every later call raises it.
        self._setup_error: Optional[BaseException] = None

    def _divides(self) -> bool:
        """Whether this sharding divides its output (row-wise mean pooling)."""
        return self._mean is not None and self._mean.divides

    @property
    def sent_steps(self) -> int:
        """How many steps this rank has sent."""
        return self._send_step

    def send_ids(self, kjt: Any) -> int:
        """Puts this rank's ids for the next step into every owner's slot; returns the
        step. Everything that may raise on this rank alone comes before the first put
        (``PgasSparseFeaturesDist`` then sends the error instead)."""
        mean = self._mean
        # A send that reports a failure must not trip over the batch again.
        reported = self._failure is not None or self._reported is not None
        divisor = None
        if mean is not None and not reported and self._key_problem(kjt.keys()) is None:
            divisor = mean.divisor(kjt, self._input_pos)
        step = self._send(kjt)
        if mean is not None:  # after the send: a send that raises leaves no divisor
            mean.sent(divisor)
        return step

    def recv_ids(self, step: int) -> "LookupInput":
        """Waits for every source's ids of ``step``; returns the owner's lookup input,
        which carries the step's route."""
        self._catch_up(step)
        # This step's divisor is taken whether or not the step can be served.
        divisor = self._mean.take() if self._mean is not None else None
        return self._recv(step, divisor)

    def _send(self, kjt: Any) -> int:
        raise NotImplementedError

    def _recv(self, step: int, divisor: Optional[torch.Tensor]) -> "LookupInput":
        raise NotImplementedError

    def lookup_put(self, batch: Any, emb_modules: Sequence[Any]) -> Optional[torch.Tensor]:
        """None: TorchRec's lookup pools the batch (see ``Exchange.lookup_put``)."""
        return None

    def _divided(self, grad: torch.Tensor, divide: bool) -> torch.Tensor:
        """``grad`` divided in place by the world size if ``divide`` (TorchRec's
        gradient division)."""
        return grad.div_(self._t.world_size) if divide else grad

    def _set_input_features(self, features: Sequence[TwFeature]) -> None:
        self._input_features = list(features)
        self._input_keys = [f.name for f in self._input_features]
        self._num_rows = torch.tensor(
            [f.num_embeddings for f in self._input_features], dtype=torch.int64, device=self._t.device
        )

    def takes_input_order(self, keys: Sequence[str]) -> bool:
        """Whether the input dist can take batches with exactly the features ``keys``,
        in that order (see ``adopt_input_order``)."""
        return self._input_order(keys) is not None

    def _input_order(self, keys: Sequence[str]) -> Optional[List[int]]:
        """``_input_pos`` for batches with the features ``keys``, or None if they lack
        one of the sharding's, name one twice, or the routing cannot route them."""
        keys = list(keys)
        names = {f.name for f in self._sharding_features}
        if len(set(keys)) != len(keys) or not names <= set(keys):
            return None
        pos = [keys.index(f.name) for f in self._sharding_features]
        return pos if self._routing.routable(pos, len(keys)) else None

    def adopt_input_order(self, keys: Sequence[str], others: Sequence[TwFeature] = ()) -> bool:
        """Makes the input dist take batches with exactly the features ``keys``, in that
        order, instead of the sharding's own: the exchange then picks its features
        and routes each to its owner itself, so the module need not permute and split
        the batch (``ShardedPgasEmbeddingBagCollection.input_dist``).

        ``keys`` may hold other shardings' features too; ``others`` gives features
        with the rows their ids index, as the module knows them (a feature the
        sharding pools too is checked against the fewer rows). Every exchange given a
        batch checks all of it, so that all of them find the same problems in it.

        Returns False, changing nothing, if ``keys`` lack one of the sharding's
        features, name one twice, hold one that neither the sharding nor ``others``
        knows, or the exchange cannot route their order. Before the first send only."""
        assert self._send_step == 0, "adopt_input_order after the first send"
        pos = self._input_order(keys)
        by_name: Dict[str, TwFeature] = {f.name: f for f in others}
        for f in self._sharding_features:
            # A feature pooled by several tables: its ids must fit the smallest.
            if f.name not in by_name or f.num_embeddings < by_name[f.name].num_embeddings:
                by_name[f.name] = f
        if pos is None or any(k not in by_name for k in keys):
            return False
        self._input_pos = pos
        self._reordered = pos != list(range(len(keys)))
        self._set_input_features([by_name[k] for k in keys])
        return True

    def _key_problem(self, keys: Sequence[str]) -> Optional[Tuple[int, int, int]]:
        return key_problem(keys, self._input_keys)

    def _raise_for_bad_headers(self, headers: Sequence[Header], step: int, texts: Sequence[str] = ()) -> None:
        """Raises, naming every source that sent a bad batch; the same on every rank,
        since every rank got the same headers (``texts``: the messages of
        ``Status.FAILED`` slots, by source). On a rank whose own send failed, the
        error it hit is the cause."""
        assert self._layout is not None
        texts = list(texts) or [""] * len(headers)
        errors = [
            describe(source, h, self._input_features, self._layout, texts[source])
            for source, h in enumerate(headers)
            if h.status != Status.OK
        ]
        cause, self._failure_cause = self._failure_cause, None
        if errors:
            raise PgasInputError(f"{self._name} step {step}: " + "; ".join(errors)) from cause

    def fail_next_send(self, error: BaseException) -> None:
        """Makes the next send report ``error`` (``Status.FAILED``, with its type and
        message) instead of the batch it is given: called when preparing a send
        raised, so every rank raises for this step rather than the peers waiting for a
        send that never comes (and taking this rank's next batch for it)."""
        self._failure = f"{type(error).__name__}: {error}"
        self._failure_cause = error

    def step_counters(self) -> Tuple[int, ...]:
        """See ``Exchange.step_counters``: the host exchanges run no CUDA graphs."""
        return ()

    def advance(self, delta: Sequence[int]) -> None:
        """See ``Exchange.advance``."""
        if any(delta):
            raise PgasError(f"{self._name}: only the GPU exchanges' steps can be captured and replayed")

    def before_replay(self) -> None:
        """See ``Exchange.before_replay``: the host exchanges run no CUDA graphs."""

    def raise_errors(self, wait: bool = False) -> None:
        """See ``Exchange.raise_errors``: every step of the host exchanges is checked
        before its output is returned."""

    def _allocate_once(self, *args: Any) -> None:
        """``_allocate(*args)``, remembering its error: a set-up that failed leaves no
        buffers, and every later call raises the original error rather than tripping
        over the missing buffers."""
        if self._setup_error is not None:
            raise setup_failed_earlier(self._name, self._setup_error) from self._setup_error
        try:
            self._allocate(*args)
        except BaseException as e:
            self._setup_error = e
            self._layout = None
            raise

    def _allocate(self, *args: Any) -> None:
        raise NotImplementedError

    # ------------------------------------------------ steps sent but not received

    def _drop_next(self) -> None:
        """Receives the next step and releases its slots without a lookup."""
        self._recv_step += 1
        self._drop_step(self._recv_step)
        if self._mean is not None:
            self._mean.take()

    def _drop_step(self, step: int) -> None:
        raise NotImplementedError

    def _make_room(self) -> None:
        """Before a send: a step sent ``DEPTH`` sends ago and still not received was
        abandoned (a pipeline dropped its batch: TorchRec's pipelines keep at most one
        batch in flight), and the new send would wait for its slots forever."""
        while self._send_step - self._recv_step >= DEFAULT_DEPTH:
            self._drop_next()

    def _catch_up(self, step: int) -> None:
        """Before receiving ``step``: drops the steps sent before it that nobody will
        receive, so a batch never gets another batch's ids."""
        if step <= self._recv_step:
            raise PgasError(
                f"{self._name}: rank {self._t.rank} waited for the ids of step {step}, which "
                f"were received already or dropped for a later batch (at most "
                f"{DEFAULT_DEPTH - 1} batch may wait between its input dist and its lookup)"
            )
        while self._recv_step + 1 < step:
            self._drop_next()

    def report_input_problem(self, status: Optional[Status], detail: Optional[Tuple[int, ...]]) -> None:
        """Makes the next send report ``status`` for its batch: the sharded module
        found the problem in the batch it was given, before TorchRec split it (None
        withdraws a report no send took). ``Status.FAILED`` takes the message as its
        detail: ``(message,)``."""
        if status == Status.FAILED:
            self._failure = str((detail or ("",))[0])
            self._failure_cause = None
            return
        if status is None:
            self._failure = None
        self._reported = None if status is None else (status, detail or ())

    def _failure_text(self, layout: IdsSlotLayout) -> torch.Tensor:
        """The message bytes of the ``Status.FAILED`` send being made."""
        return layout.encode_text(self._sending)

    def _host_problem(self, kjt: Any) -> Optional[Tuple[Status, Tuple[int, ...], int]]:
        """What is wrong with ``kjt`` that the host sees without reading its data (or
        was reported for it), as ``(status, detail, batch size to report)``, else None.
        Such a batch is sent as a bare header, so that every rank raises; a batch whose
        shape cannot be trusted reports batch size 0, which keeps every kernel and copy
        off its data."""
        if self._failure is not None:
            # Taken here, so one failure fails one send; the message is the send's to
            # put (``failure_text``), a send that puts none reports it without.
            self._sending, self._failure = self._failure, None
            self._reported = None
            return Status.FAILED, (0,), 0
        if self._reported is not None:
            (status, detail), self._reported = self._reported, None
            return status, detail, 0
        return batch_problem(kjt, self._input_keys)


def feature_rows(configs: Sequence[Any]) -> List[TwFeature]:
    """Every feature of a module's tables (``EmbeddingBagConfig``s) with the rows its
    ids index: those of its table with the fewest, where several pool it (what an
    exchange given the whole batch checks every feature's ids against)."""
    rows: Dict[str, TwFeature] = {}
    for config in configs:
        for f in config.feature_names:
            if f not in rows or config.num_embeddings < rows[f].num_embeddings:
                rows[f] = TwFeature(f, config.name, config.num_embeddings)
    return list(rows.values())


def setup_failed_earlier(name: str, error: BaseException) -> PgasError:
    """What every call after a failed set-up raises (``error`` as its cause): a
    set-up is collective, so one rank cannot retry it alone."""
    return PgasError(f"{name}: the set-up failed earlier: {error}")


def key_problem(keys: Sequence[str], expected: Sequence[str]) -> Optional[Tuple[int, int, int]]:
    """``Status.UNKNOWN_FEATURES``'s detail if ``keys`` are not the features
    ``expected``, in order, else None. Such a batch is still sent (as a bare header),
    so that every rank raises rather than waits."""
    if list(keys) == list(expected):
        return None
    first = next((i for i, (a, b) in enumerate(zip(keys, expected)) if a != b), min(len(keys), len(expected)))
    return first, len(keys), len(expected)


def batch_problem(kjt: Any, expected_keys: Sequence[str]) -> Optional[Tuple[Status, Tuple[int, ...], int]]:
    """What is wrong with ``kjt`` that the host sees without reading its data, as
    ``BaseTwExchange._host_problem`` reports it, else None."""
    problem = key_problem(kjt.keys(), expected_keys)
    if problem is not None:
        return Status.UNKNOWN_FEATURES, problem, 0
    if kjt.variable_stride_per_key():
        return Status.VARIABLE_BATCH, (), 0
    shape = shape_problem(kjt)
    if shape is not None:
        return Status.BAD_LENGTHS, shape, 0
    bad_dtype = dtype_problem(kjt.values(), kjt.weights_or_none())
    if bad_dtype is not None:
        return Status.BAD_DTYPE, (bad_dtype,), kjt.stride()
    return None


def dense_batch(kjt: Any) -> Any:
    """``kjt`` as FBGEMM's routing ops and the slots read it: values, lengths and
    per-sample weights dense (the ops read raw pointers, so a strided view, such as a
    column of a wider tensor, would be read as if it were dense), weights float32
    (FBGEMM's bucketize and permute take no half-precision weights); ``kjt`` itself if
    it is so already, or if it is VBE (refused as such; rebuilt here, it would lose its
    batch sizes)."""
    if kjt.variable_stride_per_key():
        return kjt
    values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
    dense_weights = weights is None or (weights.dtype == torch.float32 and weights.is_contiguous())
    if values.is_contiguous() and lengths.is_contiguous() and dense_weights:
        return kjt
    return type(kjt)(
        keys=kjt.keys(),
        values=values.contiguous(),
        weights=weights.to(torch.float32).contiguous() if weights is not None else None,
        lengths=lengths.contiguous(),
        stride=kjt.stride(),
    )


def shape_problem(kjt: Any) -> Optional[Tuple[int, ...]]:
    """``Status.BAD_LENGTHS``'s detail if ``kjt``'s tensors have sizes that disagree
    (read from their shapes: no sync), else None."""
    values, weights = kjt.values(), kjt.weights_or_none()
    for tensor in (values, kjt.lengths(), weights):
        if tensor is not None and tensor.dim() != 1:
            return -3, tensor.dim()
    if weights is not None and weights.numel() != values.numel():
        return -2, weights.numel(), values.numel()
    if not kjt.variable_stride_per_key() and kjt.lengths().numel() != len(kjt.keys()) * kjt.stride():
        return (-1,)
    return None


def dtype_problem(values: torch.Tensor, weights: Optional[torch.Tensor]) -> Optional[int]:
    """``Status.BAD_DTYPE``'s detail for a batch, or None if its dtypes are fine."""
    if values.dtype not in (torch.int32, torch.int64):
        return BadDtype.IDS_NOT_INTEGERS
    if weights is not None and not weights.is_floating_point():
        return BadDtype.WEIGHTS_NOT_FLOATING
    return None
