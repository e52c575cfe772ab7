"""The input and output dists and the lookup of the PGAS sharding types.

They are the same for every PGAS sharding type: what differs (which owner gets which
ids, how pooled rows come back) is the ``Exchange`` they are given (``exchange.py``).
A step goes send -> receive (a ``LookupInput`` with the step's route) -> lookup (a
``PooledLookup``: rows and route) -> output (the route goes back to the exchange) ->
gradients (the route is kept by autograd).
"""

from typing import Any, List, Optional, Sequence, Tuple, TypeVar

import torch
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_lookup import (
    GroupedPooledEmbeddingsLookup,
    embeddings_cat_empty_rank_handle,
)
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
)
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.exchange import Exchange, HostBatch, LookupInput, PooledLookup
from torchrec_pgas.transport import PgasError

T = TypeVar("T")


class _Done(Awaitable[T]):
    """An awaitable whose value is already known."""

    def __init__(self, value: T) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> T:
        return self._value


class _ReceiveIds(Awaitable[LookupInput]):
    """Waits for every source's ids of the step and forms the lookup's input."""

    def __init__(self, exchange: Exchange, step: int) -> None:
        super().__init__()
        self._exchange = exchange
        self._step = step

    def _wait_impl(self) -> LookupInput:
        return self._exchange.recv_ids(self._step)


def send_ids(exchange: Exchange, kjt: KeyedJaggedTensor) -> int:
    """``exchange.send_ids(kjt)``; if preparing the send raises on this rank (any
    error the exchange's own checks did not foresee), the step is sent anyway, as a
    report of that error: every rank then raises it for this step, and the next batch
    is the next step on every rank. Errors of the transport, and a send already made,
    are not retried: the step is lost to every rank alike."""
    sent = exchange.sent_steps
    try:
        return exchange.send_ids(kjt)
    except PgasError:
        raise
    except Exception as e:
        if exchange.sent_steps != sent:
            raise
        exchange.fail_next_send(e)
        return exchange.send_ids(kjt)


class PgasSparseFeaturesDist(BaseSparseFeaturesDist[LookupInput]):
    """Puts each owner's features into its per-source slot; no splits exchange."""

    def __init__(self, exchange: Exchange) -> None:
        super().__init__()
        self._exchange = exchange

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[LookupInput]]:
        step = send_ids(self._exchange, sparse_features)
        return _Done(_ReceiveIds(self._exchange, step))

    def send_and_receive(self, sparse_features: KeyedJaggedTensor) -> LookupInput:
        """``forward`` and both waits in one call: this rank's lookup input."""
        with torch.no_grad():  # as TorchRec's input dists run
            step = send_ids(self._exchange, sparse_features)
        return self._exchange.recv_ids(step)


class _ExchangePooled(torch.autograd.Function):
    """Forward puts pooled rows to their requesters; backward puts the gradient
    blocks back to their owners."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local_embs: torch.Tensor,
        anchor: torch.Tensor,
        exchange: Exchange,
        route: Any,
    ) -> torch.Tensor:
        ctx.exchange, ctx.route, ctx.shape = exchange, route, local_embs.shape
        return exchange.exchange_pooled(local_embs, route)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        # TorchRec's collectives average embedding gradients over ranks in backward,
        # the way DDP does for dense parameters; the exchanges match it.
        grad = ctx.exchange.exchange_grads(grad_out, ctx.route, ctx.shape, get_gradient_division())
        return grad, None, None, None


class _JoinedOutput(torch.autograd.Function):
    """The autograd node of a module's output that its shardings' output exchanges
    wrote in place, each into its columns (``PgasPooledEmbeddingDist.pooled_into``):
    the module's output without TorchRec's ``torch.cat`` of its shardings' outputs,
    which copies all of it. Backward gives each sharding its columns of the gradient
    as views, as ``torch.cat``'s backward does (divided as row-wise mean pooling
    divided the output), in reverse sharding order: the order autograd runs the
    shardings' nodes under ``torch.cat`` (later ones first), so that a rank whose
    output was concatenated exchanges gradients in the same order as its peers."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        joined: torch.Tensor,
        anchor: torch.Tensor,
        exchanges: Sequence[Exchange],
        routes: Sequence[Any],
        columns: Sequence[Tuple[int, int]],
        *local_embs: torch.Tensor,
    ) -> torch.Tensor:
        ctx.exchanges, ctx.routes, ctx.columns = exchanges, routes, columns
        ctx.shapes = [e.shape for e in local_embs]
        ctx.mark_dirty(joined)  # the exchanges wrote it
        return joined

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        divide = get_gradient_division()
        grads: List[Optional[torch.Tensor]] = [None] * len(ctx.shapes)
        for i in reversed(range(len(ctx.shapes))):
            route, (begin, end) = ctx.routes[i], ctx.columns[i]
            grad = grad_out[:, begin:end]
            if route.divisor is not None:
                grad = grad / route.divisor
            grads[i] = ctx.exchanges[i].exchange_grads(grad, route, ctx.shapes[i], divide)
        return (None, None, None, None, None, *grads)


def joined_output(
    dists: Sequence["PgasPooledEmbeddingDist"],
    lookups: Sequence[PooledLookup],
    joined: torch.Tensor,
    columns: Sequence[Tuple[int, int]],
) -> torch.Tensor:
    """A module's output, ``joined``, once every sharding has put its rows (``dists[i]``'s
    of ``lookups[i]``) into its ``columns[i]`` (``PgasPooledEmbeddingDist.pooled_into``),
    under one autograd node in grad mode."""
    if not torch.is_grad_enabled():
        return joined
    exchanges = [d._exchange for d in dists]
    # As for one sharding: every rank runs the backward exchanges, also one whose
    # lookups have nothing to differentiate.
    anchor = torch.empty(0, requires_grad=True)
    routes, embs = [x.route for x in lookups], [x.embs for x in lookups]
    return _JoinedOutput.apply(joined, anchor, exchanges, routes, columns, *embs)


class PgasPooledEmbeddingDist(BaseEmbeddingDist[EmbeddingShardingContext, PooledLookup, torch.Tensor]):
    """Puts pooled rows (or partial sums) to the requesters; returns this rank's
    pooled embeddings, ``[batch, sum of dims]``."""

    def __init__(self, exchange: Exchange, name: str) -> None:
        super().__init__()
        self._exchange = exchange
        self._name = name

    def forward(
        self,
        local_embs: PooledLookup,
        sharding_ctx: Optional[EmbeddingShardingContext] = None,
    ) -> Awaitable[torch.Tensor]:
        return _Done(self.pooled(local_embs))

    def check_lookup(self, lookup: Any) -> None:
        """Refuses anything but the PGAS lookup's output."""
        if not isinstance(lookup, PooledLookup):
            raise PgasError(
                f"{self._name}: the output dist was given a {type(lookup).__name__}, not the "
                f"PGAS lookup's output (PooledLookup)"
            )

    def pooled_into(self, lookup: PooledLookup) -> None:
        """Puts the lookup's rows and takes this rank's output into its route's ``dest``
        (the sharding's columns of the module's output: ``joined_output`` is its
        autograd node), divided there for row-wise mean pooling."""
        self.check_lookup(lookup)
        embs, route = lookup
        dest = route.dest
        try:
            with torch.no_grad():
                out = self._exchange.exchange_pooled(embs, route)
        finally:
            route.dest = None  # the route lives on with the graph: not a view of the output
        if dest is None or out.data_ptr() != dest.data_ptr() or out.shape != dest.shape:
            raise PgasError(f"{self._name}: the output exchange did not write the step's output destination")
        if route.divisor is not None:
            with torch.no_grad():
                out.div_(route.divisor)

    def pooled(self, lookup: PooledLookup) -> torch.Tensor:
        """``forward``'s output without the awaitable."""
        self.check_lookup(lookup)
        embs, route = lookup
        if not torch.is_grad_enabled():
            out = self._exchange.exchange_pooled(embs, route)
        else:
            # Every rank must run the backward exchange, also a rank whose own lookup
            # has nothing to differentiate (it owns no table): the anchor makes the
            # output require grad everywhere.
            anchor = torch.empty(0, requires_grad=True)
            out = _ExchangePooled.apply(embs, anchor, self._exchange, route)
        # Mean pooling of partial sums (row-wise) is only known once they are summed.
        return out / route.divisor if route.divisor is not None else out


class PgasGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's lookup (same modules, parameters and state) of a step's
    ``LookupInput``: the host exchanges' KJT, or the GPU exchanges' fixed-shape
    ``LookupBatch`` (already-split groups, or the pooling done by the exchange's
    ``lookup_put``). Returns the pooled rows with the step's route."""

    def __init__(self, *args: Any, exchange: Exchange, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._exchange = exchange

    def reshards(self) -> bool:
        """Whether a module has resharding awaitables (fully sharded 2D) for the
        forward to wait on."""
        return any(hasattr(m, "get_rs_awaitable") for m in self._emb_modules)

    def forward(self, sparse_features: LookupInput) -> PooledLookup:  # type: ignore[override]
        batch: Any = sparse_features
        if isinstance(batch, HostBatch):
            return PooledLookup(super().forward(batch.kjt), batch.route)
        # The GPU exchange may pool and put the rows itself (inference); the output is
        # then an empty stand-in.
        out = self._exchange.lookup_put(batch, self._emb_modules)
        if out is None:
            out = embeddings_cat_empty_rank_handle(self._forward(batch.groups), self._dummy_embs_tensor, dim=1)
        return PooledLookup(out, batch.route)
