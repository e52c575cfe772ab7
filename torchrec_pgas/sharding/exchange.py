"""The typed contract between the PGAS dists and lookup (``dists.py``) and the
exchanges that move the data (``tw_exchange``, ``rw_exchange`` on the host transport;
``tw_device_exchange``, ``rw_device_exchange`` on GPUs).

A step is explicit: ``recv_ids`` returns the lookup's input together with the step's
route (``LookupInput``), the lookup returns its pooled rows together with that route
(``PooledLookup``), and the output dist hands the route back to the exchange. Nothing
rides on a tensor, and nothing is queued between the lookup and the output dist, so a
pipeline may drop a batch after its input dist.
"""

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.ids_slot import Status


class StepRoute(Protocol):
    """What the output and gradient exchanges of one step need from its input; its
    ``divisor`` (row-wise mean pooling, ``[batch, dims]``) divides the summed output,
    and its ``dest``, if set, is where the output goes (``[batch, dims]``, a column
    slice of the module's joined output: ``dists.joined_output``)."""

    divisor: Optional[torch.Tensor]
    dest: Optional[torch.Tensor]


class LookupInput(Protocol):
    """The owner's lookup input of one step, as TorchRec's pipelines and the lookup
    handle it (``HostBatch``, ``device_batch.LookupBatch``)."""

    route: Any  # the step's ``StepRoute``

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Marks every tensor the step still reads as used on ``stream`` (pipelines lay
        the batch out on their data-dist stream)."""

    def stride(self) -> int:
        """Bags per feature (TorchRec reads the input dist's output as a KJT's)."""

    def variable_stride_per_key(self) -> bool:
        """Always False: the exchanges refuse variable batch sizes."""


@dataclass
class HostBatch:
    """The host exchanges' lookup input: the KJT TorchRec's lookup pools, and its
    step's route."""

    kjt: KeyedJaggedTensor
    route: Any

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.kjt.record_stream(stream)
        if self.route.divisor is not None:
            self.route.divisor.record_stream(stream)

    def stride(self) -> int:
        return self.kjt.stride()

    def variable_stride_per_key(self) -> bool:
        return False


def check_dest(dest: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, name: str) -> None:
    """Refuses a step's output destination (``StepRoute.dest``) that is not ``shape``
    rows of ``dtype`` with contiguous elements: the module's slice of its joined output
    must be this sharding's output exactly."""
    if list(dest.shape) != list(shape) or dest.dtype != dtype or (dest.numel() > 0 and dest.stride(-1) != 1):
        raise ValueError(
            f"{name}: the step's output destination is {dest.dtype} {list(dest.shape)} strides "
            f"{dest.stride()}, expected {dtype} {list(shape)} with contiguous rows"
        )


class PooledLookup(NamedTuple):
    """The lookup's output: this owner's pooled rows (or partial sums) of every
    source's bags, in lookup order, and the route the output dist needs to put them."""

    embs: torch.Tensor
    route: Any

    def register_hook(self, hook: Any) -> Any:
        """``embs.register_hook``: TorchRec's compute step may hook the lookup output's
        gradient (weight stashing)."""
        return self.embs.register_hook(hook)


class OutputSpec(NamedTuple):
    """This rank's output of one step: ``[rows, dim]`` of ``dtype`` on ``device``, and
    whether the sharding divides it (row-wise mean pooling: ``StepRoute.divisor``)."""

    rows: int
    dim: int
    dtype: torch.dtype
    device: torch.device
    divided: bool


class Exchange(Protocol):
    """One sharding's exchange: puts ids to their owners, pooled rows back to their
    requesters and gradients to the owners (see ``tw_exchange`` for the steps)."""

    @property
    def sent_steps(self) -> int:
        """How many steps this rank has sent."""

    def send_ids(self, kjt: KeyedJaggedTensor) -> int:
        """Puts this rank's ids for the next step into every owner's slot; returns the
        step."""

    def recv_ids(self, step: int) -> LookupInput:
        """Waits for every source's ids of ``step``; returns this owner's lookup input."""

    def lookup_put(self, batch: Any, emb_modules: Sequence[Any]) -> Optional[torch.Tensor]:
        """Pools ``batch`` and puts the rows itself, returning the lookup output's
        stand-in; or None: TorchRec's lookup pools it."""

    def output_spec(self, route: Any) -> OutputSpec:
        """This rank's output of the step of ``route``, before its lookup (a module that
        joins its shardings' outputs gives each its slice as ``route.dest``)."""

    def exchange_pooled(self, local_embs: torch.Tensor, route: Any) -> torch.Tensor:
        """Puts every requester's pooled rows; returns this rank's output (``route.dest``
        if set)."""

    def exchange_grads(
        self, grad_out: torch.Tensor, route: Any, local_embs_shape: torch.Size, divide: bool
    ) -> torch.Tensor:
        """Puts the output gradient to the owners; returns the local lookup output's."""

    def fail_next_send(self, error: BaseException) -> None:
        """Makes the next send report ``error`` instead of its batch."""

    def takes_input_order(self, keys: Sequence[str]) -> bool:
        """Whether it can take batches with exactly the features ``keys``, in that
        order (which may hold other shardings' features)."""

    def adopt_input_order(self, keys: Sequence[str], others: Sequence[Any] = ()) -> bool:
        """Takes batches with exactly the features ``keys``, in that order; ``others``:
        the other shardings' features, with the rows their ids index."""

    def report_input_problem(self, status: Optional[Status], detail: Optional[Tuple[Any, ...]]) -> None:
        """Makes the next send report ``status`` for its batch."""

    def step_counters(self) -> Tuple[int, ...]:
        """The host's counts of the steps it has enqueued (sends, receives, outputs,
        backwards), opaque: ``advance`` takes differences of them. A CUDA graph
        captures the host's enqueueing once, so whoever replays it says so."""

    def advance(self, delta: Sequence[int]) -> None:
        """Adds ``delta`` (a difference of ``step_counters``) to the counters: minus the
        captured steps after a capture (captured work does not run), plus them after
        each replay. The device keeps its own count, which the kernels read."""

    def before_replay(self) -> None:
        """Enqueues, ahead of a CUDA graph's replay, what brings the values the graph
        reads from host objects up to date on the device (the tables' learning rate,
        which a schedule changes between steps); no step."""

    def raise_errors(self, wait: bool = False) -> None:
        """Raises what the steps that have finished on the device reported (bad
        batches on any rank, timeouts), oldest first, the same on every rank; with
        ``wait``, waits for every enqueued step first. Exchanges that check every
        step on the host before returning its output have nothing to raise here."""


def raise_together(errors: Sequence[BaseException]) -> None:
    """Raises the first of ``errors`` with the others as its notes, if there is any:
    every error pending for a batch in one raise, none left over for a later one."""
    if not errors:
        return
    first, *rest = errors
    for e in rest:
        first.add_note(f"and: {type(e).__name__}: {e}")
    raise first


def raise_errors(exchanges: Sequence[Exchange], wait: bool = False) -> None:
    """``raise_errors`` of every exchange in ``exchanges`` (those of one model, between
    its steps): every one is asked before anything is raised, so one call raises every
    error pending for a batch (the first, with the others as notes) and none is left
    over for a later call."""
    errors: List[BaseException] = []
    for exchange in exchanges:
        try:
            exchange.raise_errors(wait=wait)
        except Exception as e:  # noqa: BLE001 - every exchange is asked before raising
            errors.append(e)
    raise_together(errors)
