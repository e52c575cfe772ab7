r"""Perf models of ``pgas_table_wise`` and ``pgas_row_wise`` for TorchRec's
``EmbeddingPerfEstimator``.

The lookup itself is the table-wise lookup, so the compute terms (``fwd_compute``,
``bwd_compute``, ``prefetch_compute``) are TorchRec's table-wise ones, computed on a
context relabelled as ``table_wise`` (so hardware configs that tune table-wise apply).
Only the communication differs. Table-wise moves data with NCCL all-to-alls: the input
dist first exchanges per-rank splits, then ids and lengths; the output dist waits for
the whole lookup, all-to-alls the pooled embeddings, then permutes and unpacks them.
PGAS replaces each all-to-all by one-sided puts into symmetric buffers plus one signal
per peer: there is no splits exchange and no collective to wait for, pooled rows are put
straight into the requester's output tensor as the lookup produces them, and gradients
are put straight back to the owner the same way.

Notation, per shard (all quantities are what TorchRec's ``ShardPerfContext`` holds;
times in ms, bandwidths in bytes/ms as in TorchRec's topology)::

    W        world size             L   = the topology's local world size
    B        batch_outputs per rank  d   = embedding dim
    I        batch_inputs per rank   N   = sum(num_poolings * batch_sizes), bags per rank
    s_in     input dtype size        s_f, s_b = forward / backward comm dtype size
    BW_intra, BW_inter               the topology's intra- and inter-host bandwidths
    lambda   SIGNAL_LATENCY_MS, cost of one signal to one peer

Every rank requests the same batch size, so a shard's traffic X is X / W per rank in
each direction: ids and lengths come in from every requester, pooled rows go out to
every requester, gradients come back from every requester. Rank ``r`` is on host
``r // L``. The bytes for ranks on the owner's host (the owner included: its own share
is a put like any other) cross the intra-host links, the rest the inter-host links;
the owner drives both at once, so with ``h`` the number of ranks on the owner's host::

    T_put(X, h) = max(X * h / W / BW_intra, X * (W - h) / W / BW_inter)

The planner estimates a shard before it places it, so the owner's host is unknown:
``T_put(X)`` is the mean of ``T_put(X, h)`` over the W possible owners. When L divides
W every host has ``h = L`` ranks and this is exactly ``T_put(X, L)``; on one host it is
``X / BW_intra``, and inter-host bandwidth plays no part. With ::

    T_sig    = (W - 1) * lambda

the model is::

    input_dist_comms = T_put((I + N) * W * s_in) + T_sig             # ids + lengths
    fwd_comms        = max(0, T_put(B * W * d * s_f) - fwd_compute) + T_sig
    bwd_comms        = max(0, T_put(B * W * d * s_b) - bwd_compute) + T_sig

The ``max(0, put - compute)`` terms are the puts left exposed once they overlap the
lookup (forward) or the gradient scatter (backward). TorchRec charges table-wise
``B * W * d * s / BW_a2a`` for each direction, with ``BW_a2a`` the intra-host bandwidth
on one host and the inter-host one for all bytes across hosts, although the bytes for
the owner's own host never leave it; since ``T_put`` never exceeds that, a
``pgas_table_wise`` shard costs less than the same ``table_wise`` shard whenever
``min(T_put, compute) > T_sig``, i.e. for all but tiny tables on many ranks, where the
signals are what it pays for and the planner rightly keeps ``table_wise``.

``pgas_row_wise`` uses the same terms on TorchRec's row-wise sizes (its compute terms
and ``output_write_size``, computed as for ``row_wise``): the ids go to their row
blocks' owners by puts, partial sums come back by puts in place of the reduce-scatter,
and the whole gradient goes to every owner by puts in place of the all-gather (whose
batched copy it does not need). The owner's lookup overlaps the puts as in table-wise.
"""

from dataclasses import replace
from typing import Dict, List, Tuple

from torchrec.distributed.planner.estimator.estimator import (
    EmbeddingShardingPerfEvaluator,
    InferenceShardingPerfEvaluator,
    RowWiseEvaluator,
    TableWiseEvaluator,
)
from torchrec.distributed.planner.estimator.types import (
    HardwarePerfConfig,
    ShardPerfContext,
)

from torchrec_pgas.planner.layout import torchrec_layout
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE

#: Cost, in ms, of signalling one peer. Signals to different peers are in flight together,
#: so each adds its issue cost (~100 ns), not a whole link round trip.
SIGNAL_LATENCY_MS: float = 1e-4


class _PgasComms:
    """The PGAS communication terms (see the module docstring) on top of the TorchRec
    evaluator of the same layout, whose compute terms and sizes they keep."""

    def compute_fwd_comp(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> float:
        return super().compute_fwd_comp(_as_torchrec_layout(ctx), config)  # type: ignore[misc]

    def compute_bwd_comp(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> float:
        return super().compute_bwd_comp(_as_torchrec_layout(ctx), config)  # type: ignore[misc]

    def compute_prefetch_comp(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> float:
        return super().compute_prefetch_comp(_as_torchrec_layout(ctx), config)  # type: ignore[misc]

    def _default_input_dist_comms(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> float:
        bags = sum(n * b for n, b in zip(ctx.num_poolings, ctx.batch_sizes))
        ids_and_lengths = (ctx.batch_inputs + bags) * ctx.world_size * ctx.input_data_type_size
        return self._put_ms(ctx, config, ids_and_lengths) + _signals_ms(ctx)

    def _default_fwd_comms(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> float:
        pooled = self._get_output_write_size(  # type: ignore[attr-defined]
            ctx,
            self._get_comm_data_type_size(ctx, is_fwd=True),  # type: ignore[attr-defined]
        )
        exposed = self._put_ms(ctx, config, pooled) - self.compute_fwd_comp(ctx, config)
        return max(0.0, exposed) + _signals_ms(ctx)

    def _default_bwd_comms(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> float:
        grads = self._get_output_write_size(  # type: ignore[attr-defined]
            ctx,
            self._get_comm_data_type_size(ctx, is_fwd=False),  # type: ignore[attr-defined]
        )
        exposed = self._put_ms(ctx, config, grads) - self.compute_bwd_comp(ctx, config)
        return max(0.0, exposed) + _signals_ms(ctx)

    def _put_ms(self, ctx: ShardPerfContext, config: HardwarePerfConfig, nbytes: float) -> float:
        """``T_put``: ``nbytes`` spread evenly over all ranks, mean over the owner's host."""
        (intra_bw, inter_bw) = _link_bandwidths(ctx, config)
        world = ctx.world_size
        per_rank = nbytes / world
        total_ms = 0.0
        for on_host in _host_sizes(world, ctx.local_world_size):
            off_host = world - on_host
            if off_host and inter_bw <= 0:
                raise ValueError(
                    f"the planner's topology spans {world} ranks, {ctx.local_world_size} "
                    f"per host, but its inter_host_bw is {inter_bw}; PGAS puts to ranks on "
                    "other hosts need a positive inter-host bandwidth"
                )
            intra_ms = per_rank * on_host / intra_bw
            inter_ms = per_rank * off_host / inter_bw if off_host else 0.0
            # ``on_host`` of the W possible owners are on a host of this size.
            total_ms += on_host * max(intra_ms, inter_ms)
        return total_ms / world


class PgasTableWiseEvaluator(_PgasComms, TableWiseEvaluator):
    """TorchRec perf evaluator for ``pgas_table_wise`` (see the module docstring)."""


class PgasTableWiseInferenceEvaluator(InferenceShardingPerfEvaluator, PgasTableWiseEvaluator):
    """``pgas_table_wise`` for inference: the forward terms only."""


class PgasRowWiseEvaluator(_PgasComms, RowWiseEvaluator):
    """TorchRec perf evaluator for ``pgas_row_wise``: the PGAS terms with row-wise sizes
    (see the module docstring)."""


class PgasRowWiseInferenceEvaluator(InferenceShardingPerfEvaluator, PgasRowWiseEvaluator):
    """``pgas_row_wise`` for inference: the forward terms only."""


_TRAINING_EVALUATORS: Dict[str, EmbeddingShardingPerfEvaluator] = {
    PGAS_TABLE_WISE: PgasTableWiseEvaluator(),
    PGAS_ROW_WISE: PgasRowWiseEvaluator(),
}
_INFERENCE_EVALUATORS: Dict[str, EmbeddingShardingPerfEvaluator] = {
    PGAS_TABLE_WISE: PgasTableWiseInferenceEvaluator(),
    PGAS_ROW_WISE: PgasRowWiseInferenceEvaluator(),
}


def pgas_perf_evaluator(sharding_type: str, is_inference: bool = False) -> EmbeddingShardingPerfEvaluator:
    """The perf evaluator of a PGAS sharding type.

    Args:
        sharding_type: one of ``PGAS_SHARDING_TYPES``.
        is_inference: whether to leave out the backward terms.

    Raises:
        KeyError: if ``sharding_type`` has no cost model.
    """
    evaluators = _INFERENCE_EVALUATORS if is_inference else _TRAINING_EVALUATORS
    if sharding_type not in evaluators:
        raise KeyError(f"no PGAS cost model for sharding type {sharding_type!r}")
    return evaluators[sharding_type]


def _as_torchrec_layout(ctx: ShardPerfContext) -> ShardPerfContext:
    return replace(ctx, sharding_type=torchrec_layout(ctx.sharding_type))


def _link_bandwidths(ctx: ShardPerfContext, config: HardwarePerfConfig) -> Tuple[float, float]:
    """(BW_intra, BW_inter): the hardware config's override, else the topology's.

    Read from ``ctx.comms_bandwidths``: TorchRec leaves ``ctx.intra_host_bw`` and
    ``ctx.inter_host_bw`` at 0.
    """
    comms = ctx.comms_bandwidths
    assert comms is not None, "TorchRec builds every ShardPerfContext with comms bandwidths"
    intra = config.intra_host_bw if config.intra_host_bw is not None else comms.intra_host_bw
    inter = config.inter_host_bw if config.inter_host_bw is not None else comms.inter_host_bw
    if intra <= 0:
        raise ValueError(
            f"the planner's topology has intra_host_bw {intra}; PGAS puts need a positive intra-host bandwidth"
        )
    return (intra, inter)


def _host_sizes(world_size: int, local_world_size: int) -> List[int]:
    """Ranks per host when rank ``r`` is on host ``r // local_world_size``."""
    if local_world_size <= 0:
        raise ValueError(f"the planner's topology has local_world_size {local_world_size}; it must be positive")
    return [min(local_world_size, world_size - first) for first in range(0, world_size, local_world_size)]


def _signals_ms(ctx: ShardPerfContext) -> float:
    """``T_sig``: one signal to every other rank."""
    return (ctx.world_size - 1) * SIGNAL_LATENCY_MS
