"""CUDA graphs of models with PGAS shardings: capture a step once, replay it per batch.

The GPU exchanges enqueue only device work (no size crosses to the host), so a whole
step of a TorchRec model (the sharded lookups, the dense layers, in training the
backward and the optimizers) can be recorded by ``torch.cuda.graph`` and replayed for
each new batch with one launch. Two things change for the caller, and ``capture``
handles both:

* The host's step counters. Each exchange counts on the host the steps it enqueued; a
  capture enqueues nothing that runs, and a replay runs steps the host did not
  enqueue. ``capture`` and ``CapturedStep`` tell the exchanges (``Exchange.advance``).
* Errors. The host no longer sees a replayed step's batch: the device checks it, and
  the error (a bad id on any rank, a peer that timed out) is raised on every rank once
  the step has finished on the device: by a later call, or by ``raise_errors``.

Usage, inference (``model`` a ``DistributedModelParallel`` with PGAS shardings)::

    step = capture(model, kjt)                 # the graph of model(kjt).wait()
    for batch in batches:                      # same keys and sizes as kjt
        out = step(batch).values().clone()     # outputs are overwritten by the next call
    raise_errors(model, wait=True)             # what the last steps reported

A DLRM step with dense inputs: ``capture(lambda d, k: model(d, k), dense, kjt, model=model)``.
"""

from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple, Union

import torch
from torch import nn
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_pgas.sharding.base import PgasShardingMixin
from torchrec_pgas.sharding.exchange import Exchange
from torchrec_pgas.sharding.exchange import raise_errors as _raise_errors
from torchrec_pgas.sharding.step_records import RING_ENTRIES

__all__ = ["CapturedStep", "capture", "pgas_exchanges", "raise_errors"]


def pgas_exchanges(module: nn.Module) -> List[Exchange]:
    """Every PGAS exchange of ``module`` and its submodules, once each: those of the
    PGAS shardings of its sharded modules (``ShardedPgasEmbeddingBagCollection``)."""
    found: List[Exchange] = []
    for m in module.modules():
        for sharding in getattr(m, "_embedding_shardings", ()):
            exchange = sharding.exchange if isinstance(sharding, PgasShardingMixin) else None
            if exchange is not None and all(exchange is not e for e in found):
                found.append(exchange)
    return found


def raise_errors(module: nn.Module, wait: bool = False) -> None:
    """Raises what ``module``'s PGAS exchanges found in steps that have finished on the
    device (a bad batch on any rank: ``PgasInputError``; a peer that timed out:
    ``PgasError``), the same on every rank; with ``wait``, once every enqueued step has
    finished.

    A replayed step's batch is checked on the device, so its error comes after the step
    returned: call this where a bad batch must be known (at the end of a serving loop or
    an epoch, before a checkpoint). ``CapturedStep`` calls it without waiting after each
    replay. Every exchange is asked, so one call raises every error pending for a batch
    (the first, with the others as notes) and none is left for a later call."""
    _raise_errors(pgas_exchanges(module), wait)


class _StaticTensor:
    """A dense tensor argument: the graph reads its copy."""

    def __init__(self, example: torch.Tensor) -> None:
        self.tensor = example.detach().clone()

    def arg(self) -> torch.Tensor:
        return self.tensor

    def copy_from(self, x: Any, where: str) -> None:
        t = self.tensor
        if not isinstance(x, torch.Tensor) or x.shape != t.shape or x.dtype != t.dtype:
            got = f"a tensor of shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{where}: got {got}; the step was captured with shape {tuple(t.shape)}, {t.dtype}")
        t.copy_(x)

    def poison(self) -> bool:
        return False


class _StaticKjt:
    """A ``KeyedJaggedTensor`` argument: its values, lengths and weights, copied in place."""

    def __init__(self, example: KeyedJaggedTensor, where: str) -> None:
        if example.variable_stride_per_key():
            raise ValueError(f"{where}: a KeyedJaggedTensor with a batch size per feature cannot be captured")
        self.keys = list(example.keys())
        self.stride = example.stride()
        self.parts = {
            "values": example.values().detach().clone(),
            "lengths": example.lengths().detach().clone(),
            "weights": _clone(example.weights_or_none()),
        }

    def arg(self) -> KeyedJaggedTensor:
        # A new KJT for every call: a KJT keeps the offsets it computes, and the graph
        # must compute them from the static lengths (a replay's, not the capture's).
        p = self.parts
        return KeyedJaggedTensor(
            keys=self.keys, values=p["values"], lengths=p["lengths"], weights=p["weights"], stride=self.stride
        )

    def copy_from(self, kjt: Any, where: str) -> None:
        if not isinstance(kjt, KeyedJaggedTensor):
            raise ValueError(f"{where}: got {type(kjt).__name__}; the step was captured with a KeyedJaggedTensor")
        if list(kjt.keys()) != self.keys:
            differs = [f"keys {list(kjt.keys())} (captured: {self.keys})"]
        elif kjt.variable_stride_per_key():
            differs = ["a batch size per feature"]
        else:
            new = {"values": kjt.values(), "lengths": kjt.lengths(), "weights": kjt.weights_or_none()}
            differs = [
                f"{name} {_describe(new[name])} (captured: {_describe(static)})"
                for name, static in self.parts.items()
                if _layout(new[name]) != _layout(static)
            ]
        if differs:
            raise ValueError(
                f"{where}: the KeyedJaggedTensor differs from the captured one in {'; '.join(differs)}: a graph "
                f"replays fixed sizes (pad batches to the captured sizes, or capture a step per shape)"
            )
        for name, static in self.parts.items():
            if static is not None:
                static.copy_(new[name])

    def poison(self) -> bool:
        lengths = self.parts["lengths"]
        if lengths.numel() == 0:
            return False
        lengths[:1] = -1
        return True


class _Constant:
    """A plain argument (None, bool, int, float, str): fixed at capture."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def arg(self) -> Any:
        return self.value

    def copy_from(self, x: Any, where: str) -> None:
        if type(x) is not type(self.value) or x != self.value:
            raise ValueError(f"{where}: got {x!r}; the step was captured with the constant {self.value!r}")

    def poison(self) -> bool:
        return False


_Static = Union[_StaticTensor, _StaticKjt, _Constant]


def _clone(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().clone()


def _layout(t: Optional[torch.Tensor]) -> Optional[Tuple[Tuple[int, ...], torch.dtype]]:
    return None if t is None else (tuple(t.shape), t.dtype)


def _describe(t: Optional[torch.Tensor]) -> str:
    return "absent" if t is None else f"of shape {tuple(t.shape)}, {t.dtype}"


def _static(x: Any, where: str) -> _Static:
    if isinstance(x, (torch.Tensor, KeyedJaggedTensor)):
        device = x.device() if isinstance(x, KeyedJaggedTensor) else x.device
        if device.type != "cuda":
            raise ValueError(f"{where} is on {device}: a captured step's inputs live on the GPU it runs on")
        return _StaticKjt(x, where) if isinstance(x, KeyedJaggedTensor) else _StaticTensor(x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return _Constant(x)
    raise TypeError(
        f"{where}: got {type(x).__name__}; a captured step takes tensors, KeyedJaggedTensors and plain constants "
        f"(pass the fields of a batch object, and build it inside the function)"
    )


def _wait(out: Any) -> Any:
    """``out`` with TorchRec's awaitables waited for, inside the capture (their work must
    be in the graph), checked to hold tensors only (the graph's static outputs)."""
    if isinstance(out, Awaitable):
        out = out.wait()
    if out is None or isinstance(out, (torch.Tensor, KeyedTensor)):
        return out
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(_wait(o) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_wait(o) for o in out)
    if isinstance(out, dict):
        return {k: _wait(v) for k, v in out.items()}
    raise TypeError(
        f"the captured function returned {type(out).__name__}: return tensors, KeyedTensors, or tuples, "
        f"lists or dicts of them"
    )


#: What torch and the CUDA runtime say when a captured stream is synchronized with.
_SYNC_SIGNS = ("capturing", "during capture", "graph capture", "stream capture", "capture_end")


def _capture_error(e: BaseException) -> BaseException:
    """``e``, or an error naming the likely causes if CUDA or torch refused an operation
    during the capture (at the call, or at the capture's end: the first one is named)."""
    refused, seen = None, e
    while seen is not None:
        if any(sign in str(seen).lower() for sign in _SYNC_SIGNS):
            refused = seen
        seen = seen.__cause__ or seen.__context__
    if refused is None:
        return e
    return RuntimeError(
        f"capture failed: the step did what a CUDA graph cannot record ({type(refused).__name__}: "
        f"{str(refused).strip().splitlines()[0]}). A graph records device work only; likely causes: reading "
        f"a value or size back to the host (.item(), .tolist(), .cpu(), bool() or print of a CUDA tensor, "
        f"KeyedJaggedTensor.to_dict/split/permute, the all-to-alls of TorchRec's own sharding types), a "
        f"synchronization (torch.cuda.synchronize, a copy from pageable host memory), or an optimizer that "
        f"is not capturable (Adam, AdamW: capturable=True). One eager step under "
        f"torch.cuda.set_sync_debug_mode('error') finds a synchronization."
    )


class CapturedStep:
    """A step captured by ``capture``; call it with new arguments of the captured sizes.

    Each call copies the arguments into the graph's static inputs, replays the graph,
    advances every exchange's host counters by the captured steps and raises the errors
    of the steps that have finished on the device (not waiting): usually earlier steps'.
    It returns the graph's static outputs, the same tensors every call: the next call
    overwrites them, so clone what you keep. The host runs at most a few dozen replays
    ahead of the device (the exchanges keep the records of their last 64 steps for the
    host to read): a call past that waits for the oldest replay to finish.

    Arguments of other sizes raise ``ValueError`` on their rank. Its peers are then
    already replaying, waiting for this rank's ids: the step is replayed anyway, with a
    negative length in the first KeyedJaggedTensor argument, so every rank raises
    ``PgasInputError`` for it (naming this rank) and its outputs are NaN. Without a
    KeyedJaggedTensor argument the peers' steps time out instead.
    """

    def __init__(
        self,
        graph: "torch.cuda.CUDAGraph",
        inputs: List[_Static],
        outputs: Any,
        exchanges: List[Exchange],
        steps: List[Tuple[int, ...]],
    ) -> None:
        self._graph = graph
        self._inputs = inputs
        self._outputs = outputs
        self._exchanges = exchanges
        self._steps = steps
        # The GPU exchanges keep the records of their last RING_ENTRIES steps for the
        # host to read, and a replay writes them without the host running the
        # exchange: the host stays within half of that of the device.
        per_replay = max((abs(n) for counts in steps for n in counts), default=1)
        self._max_ahead = max(1, RING_ENTRIES // (2 * max(per_replay, 1)))
        self._in_flight: Deque[torch.cuda.Event] = deque()  # the replays' ends

    def __call__(self, *args: Any) -> Any:
        if len(args) != len(self._inputs):
            raise TypeError(f"the step was captured with {len(self._inputs)} arguments, got {len(args)}")
        try:
            with torch.no_grad():
                for i, (static, arg) in enumerate(zip(self._inputs, args)):
                    static.copy_from(arg, f"argument {i}")
        except ValueError as e:
            if any(static.poison() for static in self._inputs):
                self._replay()
                e.add_note("The step was replayed with a negative length: every rank raises PgasInputError for it.")
            raise
        self._replay()
        _raise_errors(self._exchanges, wait=False)
        return self._outputs

    def _replay(self) -> None:
        if len(self._in_flight) >= self._max_ahead:
            self._in_flight.popleft().synchronize()
        for exchange in self._exchanges:
            exchange.before_replay()
        self._graph.replay()
        done = torch.cuda.Event()
        done.record()
        self._in_flight.append(done)
        for exchange, steps in zip(self._exchanges, self._steps):
            exchange.advance(steps)


def capture(
    fn: Callable[..., Any], *example_args: Any, warmup: int = 3, model: Optional[nn.Module] = None
) -> CapturedStep:
    """Captures ``fn(*example_args)`` into a CUDA graph; returns the step that replays it.

    ``fn`` runs ``warmup`` times eagerly first, on a side stream, as torch's recipe wants
    (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs): what is made on first
    use (the exchanges' buffers, autograd's gradients, cuBLAS's workspace) is made
    outside the graph. They are real steps: a training step trains on the example batch
    ``warmup`` times. Then one call is captured, which runs nothing.

    Args:
        fn: the step: a model, or a function of tensors, ``KeyedJaggedTensor``s and plain
            constants (build batch objects inside it). It returns tensors, KeyedTensors,
            or tuples, lists or dicts of them; TorchRec's awaitables (a sharded module's
            output) are waited for inside the capture. It may not synchronize with the
            host (the error names the likely causes). The grad mode at capture is the
            step's: capture inference under ``torch.no_grad()``.
        example_args: a batch, on the GPU; each replay takes arguments of the same kinds
            and sizes (KeyedJaggedTensors: same keys, and values, lengths and weights of
            the same sizes and dtypes).
        warmup: eager calls before the capture (at least 1).
        model: the module whose PGAS exchanges ``fn`` steps (default: ``fn`` itself). An
            exchange stepped by ``fn`` but outside ``model`` would keep wrong counts.

    Every rank must capture at the same point of its sequence of steps and replay its
    graph as many times as its peers (eager steps of the same model may come between,
    in the same order on every rank): each replay is one step of every exchange it
    drives, matched with the peers' steps.

    Errors: a bad batch on any rank (an id out of range, a negative length) makes that
    step's outputs NaN on every rank; every rank raises its ``PgasInputError`` (naming
    the rank and the problem) at a later call of the step, once the step has finished
    on the device, or at ``raise_errors(model, wait=True)``, which waits for it. Batches
    after it are served normally.

    Training: ``fn`` may run the forward, ``loss.backward()`` and ``optimizer.step()``.
    FBGEMM's fused optimizers update the tables inside the backward, at the learning
    rate their ``param_groups`` hold when the step is called: a
    ``torch.optim.lr_scheduler`` stepped between calls works as in eager steps that
    call the optimizer's ``zero_grad()`` first; one advanced inside ``fn`` (TorchRec's
    ``WarmupOptimizer``) is not, as no Python of ``fn`` runs at a replay. A dense optimizer
    must be capturable: ``torch.optim.SGD`` is; Adam and AdamW need ``capturable=True``;
    an optimizer that keeps state on the host (Adagrad's step count) replays the update
    it computed at capture, exact only while that state does not change it (Adagrad with
    ``lr_decay=0``). ``fn`` must clear the gradients itself, before the backward
    (``zero_grad()``): captured, ``set_to_none=True`` makes the backward write fresh
    gradients into the graph's memory, ``False`` zeros them in place; gradients left
    from the warm-up and not cleared would be added to at every replay.
    Dense layers under ``DistributedDataParallel`` (DMP's default): torch's recipe asks
    for ``warmup=11``, DDP built on a side stream (``DistributedModelParallel(...,
    init_data_parallel=False)``, then ``init_data_parallel()`` under
    ``torch.cuda.stream(s)``) and ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``.

    A capture that fails leaves the model's exchanges in an unknown state (their host
    side prepared a step that never ran): rebuild the model.
    """
    if warmup < 1:
        raise ValueError(f"warmup={warmup}: at least one eager call must come before the capture")
    if not torch.cuda.is_available():
        raise RuntimeError("capture needs CUDA")
    if model is None:
        if not isinstance(fn, nn.Module):
            raise TypeError("capture: pass model=, the module whose PGAS exchanges fn steps")
        model = fn
    inputs = [_static(x, f"argument {i}") for i, x in enumerate(example_args)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            _wait(fn(*(s.arg() for s in inputs)))
    torch.cuda.current_stream().wait_stream(side)
    exchanges = pgas_exchanges(model)
    _raise_errors(exchanges, wait=True)  # the warm-up's errors, not the first replay's
    before = [ex.step_counters() for ex in exchanges]
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: NVSHMEM's proxy and a process group's watchdog may call CUDA
        # from their own threads meanwhile; this thread's syncs still fail the capture.
        # On the warm-up's stream: what the exchanges keep per stream (scratch made and
        # initialised at first use) is then made eagerly, not inside this graph, where
        # a second graph captured on the same stream would find it uninitialised.
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            outputs = _wait(fn(*(s.arg() for s in inputs)))
    except Exception as e:
        error = _capture_error(e)
        if error is e:
            raise
        cpu = [name for name, b in model.named_buffers() if b.device.type == "cpu"]
        if cpu:
            error.add_note(
                f"Buffers of the model on the CPU, copied to the GPU at every step: {', '.join(cpu)} "
                f"(DistributedModelParallel moves the modules that have parameters only; TorchRec's DLRM "
                f"makes its interaction indices on the CPU: move them, e.g. dlrm.inter_arch.to(device))."
            )
        raise error from e
    finally:
        # The captured steps were counted on the host and did not run: uncount them.
        steps = [tuple(a - b for a, b in zip(ex.step_counters(), b0)) for ex, b0 in zip(exchanges, before)]
        for exchange, counts in zip(exchanges, steps):
            exchange.advance(tuple(-n for n in counts))
    return CapturedStep(graph, inputs, outputs, exchanges, steps)
