"""The sharder and sharded module that put the PGAS sharding types into TorchRec."""

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import (
    EmbeddingSharding,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
    KJTListSplitsAwaitable,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionAwaitable,
    EmbeddingBagCollectionContext,
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.memory_stashing import MemoryStashingManager
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    NoWait,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

from torchrec_pgas.sharding.agreement import check_ranks_agree, plan_placement, table_description
from torchrec_pgas.sharding.base import PgasShardingMixin
from torchrec_pgas.sharding.batch_checks import (
    first_batch_problem,
    input_problem,
    module_batch_problem,
    raise_on_every_rank,
    send_problem,
    torchrec_batch_problem,
)
from torchrec_pgas.sharding.dists import joined_output, send_ids
from torchrec_pgas.sharding.exchange import HostBatch, PooledLookup, raise_errors
from torchrec_pgas.sharding.tw_base import BaseTwExchange, PgasInputError, dense_batch, feature_rows
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_SHARDING_TYPES, PGAS_TABLE_WISE, PgasOptions


def _unaligned_columns(module: EmbeddingBagCollection, params: Dict[str, ParameterSharding]) -> Optional[str]:
    """FBGEMM's batched kernels other than the dense one (``fused``, ``fused_uvm``, ...)
    take only column shards of a multiple of 4 elements, which TorchRec asserts while
    it builds the lookup, on the ranks that own the table alone (the others then wait
    for them): said here, to be refused on every rank, naming the tables."""
    bad = {}
    for config in module.embedding_bag_configs():
        param = params.get(config.name)
        if param is None or param.compute_kernel == EmbeddingComputeKernel.DENSE.value:
            continue
        spec = param.sharding_spec
        widths = {shard.shard_sizes[1] for shard in spec.shards} if spec is not None else {config.embedding_dim}
        if any(w % 4 for w in widths):
            bad[config.name] = sorted(widths)
    if not bad:
        return None
    return (
        f"table(s) {sorted(bad)} would have shards of {bad} columns: FBGEMM's batched kernels "
        f"other than 'dense' need a multiple of 4; use dims, or column-wise shard widths, "
        f"that are multiples of 4, or the 'dense' compute kernel (a hand-written plan's "
        f"compute_kernel='dense': TorchRec's planner does not offer it)"
    )


def _bf16_on_cpu(
    module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], device: Optional[torch.device]
) -> Optional[str]:
    """FBGEMM's CPU lookup has no bfloat16 kernel: it raises at the first forward, on
    the ranks that own such a table alone (the others then time out): said here, to
    be refused on every rank, naming the tables."""
    if device is None or device.type != "cpu":
        return None
    bad = [
        c.name
        for c in module.embedding_bag_configs()
        if c.data_type == DataType.BF16
        and c.name in params
        and params[c.name].compute_kernel != EmbeddingComputeKernel.DENSE.value
    ]
    if not bad:
        return None
    return (
        f"table(s) {sorted(bad)} are bfloat16 on CPU ranks: FBGEMM's CPU lookup has no "
        f"bfloat16 kernel; use fp32 or fp16 tables there, or the 'dense' compute kernel"
    )


def _check_ranks_agree(
    module: EmbeddingBagCollection,
    params: Dict[str, ParameterSharding],
    env: ShardingEnv,
    options: PgasOptions,
    fused_params: Optional[Dict[str, Any]],
    device: Optional[torch.device],
) -> None:
    """Raises on every rank unless every rank builds this module from the same tables,
    plan, output dtype and options, and its plan is one the module can take: a rank
    that sees a table larger than its owner does would send ids past the owner's rows
    (which the GPU lookup does not check again), and a rank that raised alone would
    leave its peers waiting in the next collective."""
    pg = getattr(env, "sharding_pg", None) or env.process_group
    if pg is None:  # a local environment (one process): nothing to agree with
        return
    dtype = (fused_params or {}).get("output_dtype")
    output = f", output {dtype.name if dtype is not None else 'FP32'}"
    placed = {name: plan_placement(p) + output for name, p in params.items()}
    tables = [
        table_description(c, module.is_weighted(), placed.get(c.name, "not in the plan"))
        for c in module.embedding_bag_configs()
    ]
    problem = _unaligned_columns(module, params) or _bf16_on_cpu(module, params, device)
    check_ranks_agree(options, tables, pg, "sharding an EmbeddingBagCollection", problem)


class ShardedPgasEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """A ``ShardedEmbeddingBagCollection`` that also builds the PGAS sharding types.

    TorchRec's own sharding types are built exactly as TorchRec builds them, so one
    module can mix ``pgas_table_wise`` tables with ``table_wise`` or ``row_wise`` ones.
    """

    def __init__(self, *args: Any, pgas_options: PgasOptions, **kwargs: Any) -> None:
        # The parent constructor calls create_embedding_bag_sharding, which needs the
        # options, before nn.Module.__init__ has run: bypass Module.__setattr__.
        object.__setattr__(self, "_pgas_options", pgas_options)
        super().__init__(*args, **kwargs)
        self._refuse_mean_across_row_wise_kinds()
        # Per feature of TorchRec's own sharding types, the rows its ids must be in.
        self._torchrec_rows = self._torchrec_feature_rows()
        # Whether batches go to every sharding (all PGAS ones) as they are (decided on
        # the first).
        self._pgas_direct: Optional[bool] = None
        # The features of the first batch TorchRec's input dist took, in its order.
        self._batch_keys: Optional[List[str]] = None

    @property
    def post_lookup_tracker_fn(self) -> Optional[Callable[..., None]]:
        """TorchRec's post-lookup tracker hook, given the lookup's KJT and pooled rows
        as under TorchRec's sharding types (a PGAS lookup's input and output carry the
        step's route beside them)."""
        return self.__dict__.get("_pgas_post_lookup_tracker")

    @post_lookup_tracker_fn.setter
    def post_lookup_tracker_fn(self, fn: Optional[Callable[..., None]]) -> None:
        # TorchRec calls the getter's value with what the lookup got and returned, so
        # the getter returns the unwrapping function; ``__wrapped__`` is ``fn``.
        if fn is None:
            self.__dict__["_pgas_post_lookup_tracker"] = None
            return
        user_fn = fn

        @functools.wraps(user_fn)
        def unwrapped(features: Any, embs: Any, *args: Any) -> None:
            user_fn(
                features.kjt if isinstance(features, HostBatch) else features,
                embs.embs if isinstance(embs, PooledLookup) else embs,
                *args,
            )

        self.__dict__["_pgas_post_lookup_tracker"] = unwrapped

    def _refuse_mean_across_row_wise_kinds(self) -> None:
        """TorchRec divides its whole output by one mean divisor when a table of its
        own row-wise types pools by mean (its own ``table_wise`` columns beside them
        come out wrong too), and ``pgas_row_wise`` divides its own columns: in one
        module with PGAS tables, TorchRec's row-wise tables and mean pooling on either
        side, some columns would be divided wrongly. Refused on every rank, naming the
        tables."""
        torchrec_rs = {f for features in self._pooling_type_to_rs_features.values() for f in features}
        kinds = (PGAS_TABLE_WISE, PGAS_ROW_WISE)
        ours = [c for c in self._embedding_bag_configs if self.module_sharding_plan[c.name].sharding_type in kinds]
        if not ours or not torchrec_rs:
            return
        ours_rw = [c for c in ours if self.module_sharding_plan[c.name].sharding_type == PGAS_ROW_WISE]
        if PoolingType.MEAN.value in self._pooling_type_to_rs_features or any(
            c.pooling == PoolingType.MEAN for c in ours_rw
        ):
            types = "/".join(
                t for t in kinds if any(self.module_sharding_plan[c.name].sharding_type == t for c in ours)
            )
            raise ValueError(
                f"{types} tables {[c.name for c in ours]} and TorchRec row_wise / "
                f"table_row_wise features {sorted(torchrec_rs)} in one module, with mean pooling on "
                f"one side: TorchRec's mean divisor would apply to every column; shard the row-wise "
                f"tables all {PGAS_ROW_WISE} (which divides its own columns), or put TorchRec's in a "
                f"module of their own"
            )

    def forward(self, *input: Any, **kwargs: Any) -> LazyAwaitable[KeyedTensor]:
        """TorchRec's forward. A module whose batches go straight to its PGAS
        shardings takes the same steps (send to every sharding, receive from every
        one, then each one's lookup and output) without TorchRec's context and chain
        of awaitables: their host time is a large share of a step whose time is the
        host's."""
        if len(input) == 1 and not kwargs and self._steps_directly(input[0]):
            exchanges = self._pgas_exchanges
            raise_errors(exchanges)  # what earlier steps reported, before this one starts
            with torch.no_grad():  # as TorchRec's input dists run
                steps = [send_ids(x, input[0]) for x in exchanges]
            return self._looked_up_and_output([x.recv_ids(step) for x, step in zip(exchanges, steps)])
        return super().forward(*input, **kwargs)

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input: Any) -> LazyAwaitable[KeyedTensor]:
        """TorchRec's (its pipelines' way in after the input dist), or for a module on
        the direct path the same steps as ``forward``'s, whose output is joined in
        place."""
        if self._pgas_direct is True and not ctx.variable_batch_per_feature and self._no_torchrec_extras():
            return self._looked_up_and_output(list(input))
        return super().compute_and_output_dist(ctx, input)

    def _looked_up_and_output(self, batches: List[Any]) -> LazyAwaitable[KeyedTensor]:
        """Each sharding's lookup and output of a step's ``batches``, as TorchRec's
        output type (callers test for it, and index it lazily), over the shardings'
        columns in their order, as TorchRec's path gives them: written in place into
        one output where they can be (``_joined_output``), else concatenated by
        TorchRec."""
        joined = self._joined_output(self._pgas_exchanges, batches)
        pooled, looked_up = [], []
        # Each sharding's output right after its lookup, as TorchRec's steps run them:
        # a step that raises in one sharding's output (checked now) then leaves the
        # later shardings' lookups unrun, and so the step is dropped alike everywhere.
        for lookup, output_dist, batch in zip(self._lookups, self._output_dists, batches):
            embs = lookup(batch)
            lookup.wait_for_forward()
            if joined is None:
                pooled.append(NoWait(output_dist.pooled(embs)))
            else:
                output_dist.pooled_into(embs)
            looked_up.append(embs)
        if joined is not None:
            out, columns = joined
            pooled = [NoWait(joined_output(self._output_dists, looked_up, out, columns))]
        return EmbeddingBagCollectionAwaitable(
            awaitables=pooled,
            embedding_dims=self._embedding_dims,
            embedding_names=self._embedding_names,
            module_fqn=self._module_fqn,
            sharding_types=self._sharding_types,
        )

    def _joined_output(
        self, exchanges: List[BaseTwExchange], batches: List[Any]
    ) -> Optional[Tuple[torch.Tensor, List[Tuple[int, int]]]]:
        """The module's output of a step of several shardings, and each one's columns
        in it: each batch's route gets its slice as ``dest``, which its lookup and
        output exchange fill, so that no ``torch.cat`` copies the module's output
        (``dists.joined_output``). None where the shardings' outputs are kept apart
        for TorchRec's ``torch.cat``: one sharding, or outputs that differ in rows,
        dtype or device (a bad batch's), columns that do not start at multiples of 4
        (the put kernels store 4 elements at once), or outputs narrower than the
        float32 of a row-wise mean's division."""
        if len(batches) < 2:
            return None
        specs = [x.output_spec(b.route) for x, b in zip(exchanges, batches)]
        first = specs[0]
        if any((s.rows, s.dtype, s.device) != (first.rows, first.dtype, first.device) for s in specs):
            return None
        if any(s.dim % 4 for s in specs) or sum(s.dim for s in specs) != sum(self._embedding_dims):
            return None
        # Row-wise mean divides by float32 divisors: a narrower output is promoted,
        # which ``torch.cat`` then does for the whole output (the plan's, every rank's).
        if any(s.divided for s in specs) and torch.promote_types(first.dtype, torch.float32) != first.dtype:
            return None
        out = torch.empty(first.rows, sum(s.dim for s in specs), dtype=first.dtype, device=first.device)
        columns, begin = [], 0
        for spec, batch in zip(specs, batches):
            columns.append((begin, begin + spec.dim))
            batch.route.dest = out[:, begin : begin + spec.dim]
            begin += spec.dim
        return out, columns

    @property
    def _pgas_exchanges(self) -> List[BaseTwExchange]:
        """Every sharding's exchange, in sharding order (all PGAS shardings: the
        direct path only)."""
        exchanges = [s.exchange for s in self._embedding_shardings if isinstance(s, PgasShardingMixin)]
        assert len(exchanges) == len(self._embedding_shardings) and all(x is not None for x in exchanges)
        return exchanges  # type: ignore[return-value]

    def _steps_directly(self, features: Any) -> bool:
        """Whether ``forward`` may skip TorchRec's steps for this batch: batches go to
        the shardings as they are (decided on the first), and nothing TorchRec's
        steps would add is in use (hooks on the input and output dists, which the
        direct steps do not call as modules; trackers, weight stashing, resharding
        awaitables; variable batch sizes, which the exchanges refuse)."""
        if self._pgas_direct is not True or not isinstance(features, KeyedJaggedTensor):
            return False
        return (
            not any(d._forward_hooks or d._forward_pre_hooks for d in self._input_dists)
            and not features.variable_stride_per_key()
            and self._no_torchrec_extras()
        )

    def _no_torchrec_extras(self) -> bool:
        """Whether nothing that TorchRec's lookup and output steps add is in use: hooks
        on the output dists (the direct steps do not call them as modules), trackers,
        weight stashing, resharding awaitables."""
        return (
            not any(d._forward_hooks or d._forward_pre_hooks for d in self._output_dists)
            and getattr(self, "post_lookup_tracker_fn", None) is None
            and getattr(self, "post_odist_tracker_fn", None) is None
            and not MemoryStashingManager.is_enabled()
            and not any(lookup.reshards() for lookup in self._lookups)
        )

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor) -> Awaitable[Awaitable[Any]]:
        """TorchRec's input dist, after a check of the batch on the host: a problem
        found on one rank becomes the same ``PgasInputError`` on every rank, for this
        step, before TorchRec's code touches the batch (its permute would read out of
        bounds at a negative length, and a rank that raised alone would leave its peers
        waiting, or serving its next batch). Modules that run TorchRec's own sharding
        types agree on it by one small collective; modules of PGAS types only send the
        problem in place of the batch (their exchanges raise it on every rank)."""
        # What earlier steps reported on GPUs (``Exchange.raise_errors``), raised before
        # any of this step's sends: never in the middle of a step.
        raise_errors([x for s in self._embedding_shardings if (x := getattr(s, "exchange", None)) is not None])
        if self._pgas_direct is None:
            self._pgas_direct = self._adopt_input_order(features)
        if self._pgas_direct and isinstance(features, KeyedJaggedTensor):
            return self._direct_input_dist(ctx, features)
        pgas = [s for s in self._embedding_shardings if isinstance(s, PgasShardingMixin)]
        if not pgas or not isinstance(features, KeyedJaggedTensor):
            return super().input_dist(ctx, features)
        problem = module_batch_problem(features, self._batch_keys, self._sharding_feature_names())
        if problem is None and self._has_uninitialized_input_dist:
            problem = first_batch_problem(features, self._embedding_bag_configs)
        if len(pgas) < len(self._embedding_shardings):
            if problem is None:
                problem = torchrec_batch_problem(features, self._torchrec_rows)
            raise_on_every_rank(self._env.process_group, problem)
        elif problem is not None:
            return self._refused_input_dist(ctx, features, problem)
        if self._batch_keys is None:
            self._batch_keys = list(features.keys())
        # As the PGAS slots hold them: TorchRec's permute takes no bfloat16 weights, and
        # FBGEMM's ops read strided values as if they were dense (VBE batches as they are).
        features = dense_batch(features)
        return super().input_dist(ctx, features)

    def _torchrec_feature_rows(self) -> Dict[str, Tuple[str, int]]:
        """Per feature of a table in one of TorchRec's own sharding types: its table's
        name and row count (of the smallest such table, for a feature several read)."""
        rows: Dict[str, Tuple[str, int]] = {}
        for c in self._embedding_bag_configs:
            if self.module_sharding_plan[c.name].sharding_type in PGAS_SHARDING_TYPES:
                continue
            for f in c.feature_names:
                if f not in rows or c.num_embeddings < rows[f][1]:
                    rows[f] = (c.name, c.num_embeddings)
        return rows

    def _sharding_feature_names(self) -> List[str]:
        return [f for s in self._embedding_shardings for f in s.feature_names()]

    def _refused_input_dist(
        self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor, problem: str
    ) -> Awaitable[Awaitable[Any]]:
        """The input dist of a batch refused in a module of PGAS shardings only: each
        sharding sends ``problem`` in place of its part of the batch, and every rank
        raises for this step where it receives it. TorchRec's input dist stays out of
        it: set up by a stand-in, it would keep the stand-in's feature order for good."""
        ctx.variable_batch_per_feature = False
        awaitables = []
        with torch.no_grad():
            for sharding in self._embedding_shardings:
                dist_ = sharding.create_input_dist()
                awaitables.append(send_problem(sharding, features, problem, sharding.feature_names(), dist_))
                ctx.sharding_contexts.append(EmbeddingShardingContext(batch_size_per_feature_pre_a2a=[]))
        return KJTListSplitsAwaitable(awaitables, ctx, self._module_fqn, self._sharding_types)

    def _direct_input_dist(
        self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[Any]]:
        """The input dist of a module whose tables are all in PGAS shardings: the whole
        batch goes to every sharding as it is, and each one's exchange picks its own
        features, routes each to its owner (and checks the batch). TorchRec's would
        permute the batch into the shardings' feature order and split it, which reads
        every feature's length back to the host. Every sharding's step is sent before
        any is received: a rank then raises where its peers do, at the first sharding
        whose step reports a problem, and the later shardings' steps are dropped alike
        on every rank at their next receive."""
        # A batch with a variable batch per feature goes too: the exchanges refuse it.
        ctx.variable_batch_per_feature = features.variable_stride_per_key()
        ctx.inverse_indices = features.inverse_indices_or_none()
        batch_size_per_key = dict(zip(features.keys(), features.stride_per_key()))
        awaitables = []
        with torch.no_grad():
            for sharding, input_dist in zip(self._embedding_shardings, self._input_dists):
                awaitables.append(input_dist(features))
                ctx.sharding_contexts.append(
                    EmbeddingShardingContext(
                        batch_size_per_feature_pre_a2a=[batch_size_per_key.get(f, 0) for f in sharding.feature_names()],
                        variable_batch_per_feature=ctx.variable_batch_per_feature,
                    )
                )
        return KJTListSplitsAwaitable(awaitables, ctx, self._module_fqn, self._sharding_types)

    def _adopt_input_order(self, features: Any) -> bool:
        """On the first batch, collectively: whether batches go to the shardings
        directly from now on, in this batch's feature order: if every sharding is a
        PGAS one, the batch has exactly the module's features, and every sharding's
        exchange can route their order. Only if every rank has the same order: a
        problem's detail names a feature by its position, which every rank must read
        alike. If so, sets the input dists up as TorchRec does. Raises on every rank
        if some rank's batch fails TorchRec's validation (the next batch decides
        again)."""
        shardings = self._embedding_shardings
        if not all(isinstance(s, PgasShardingMixin) for s in shardings) or self._has_mean_pooling_callback:
            return False  # the plan's, the same on every rank
        eligible = isinstance(features, KeyedJaggedTensor) and not features.variable_stride_per_key()
        keys = list(features.keys()) if eligible else None
        # TorchRec validates a model's first batch, raising on the rank that sent a bad
        # one: here every rank learns of it (a problem the exchange reports itself, such
        # as lengths that disagree with the values, is left to the exchange). Keys
        # named twice are said as TorchRec's path says them, naming the keys.
        invalid = None
        if keys is not None and len(set(keys)) != len(keys):
            invalid = f"features {keys} name a feature twice"
        elif eligible and self._has_uninitialized_input_dist and input_problem(features) is None:
            try:
                validate_keyed_jagged_tensor(features, self._embedding_bag_configs)
            except ValueError as e:
                invalid = str(e)
        pg = shardings[0]._pg
        everyone: List[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(everyone, (keys, invalid), group=pg)
        errors = [f"rank {r} sent an invalid KJT: {e}" for r, (_, e) in enumerate(everyone) if e]
        if errors:
            raise PgasInputError("; ".join(errors))
        if keys is None or any(k != keys for k, _ in everyone):
            return False
        exchanges = self._pgas_exchanges
        if set(keys) != set(self._sharding_feature_names()) or not all(x.takes_input_order(keys) for x in exchanges):
            return False
        if self._has_uninitialized_input_dist:
            self._create_input_dist(keys)
            self._has_uninitialized_input_dist = False
        rows = feature_rows(self._embedding_bag_configs)
        for x in exchanges:
            adopted = x.adopt_input_order(keys, rows)
            assert adopted, "an exchange refused the input order it said it takes"
        return True

    def create_embedding_bag_sharding(  # type: ignore[override]
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        if sharding_type == PGAS_TABLE_WISE:
            from torchrec_pgas.sharding.table_wise import PgasTwPooledEmbeddingSharding

            return PgasTwPooledEmbeddingSharding(sharding_infos, env, device, options=self._pgas_options)
        if sharding_type == PGAS_ROW_WISE:
            from torchrec_pgas.sharding.row_wise import PgasRwPooledEmbeddingSharding

            return PgasRwPooledEmbeddingSharding(sharding_infos, env, device, options=self._pgas_options)
        return super().create_embedding_bag_sharding(
            sharding_infos,
            env,
            device,
            permute_embeddings=permute_embeddings,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )


class PgasEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` that offers the PGAS sharding types too.

    Args:
        fused_params: forwarded to TorchRec (optimizer, learning rate, ...).
        qcomm_codecs_registry: forwarded to TorchRec for its own sharding types.
        options: run-time options of the PGAS sharding types.
    """

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        options: Optional[PgasOptions] = None,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._pgas_options = options or PgasOptions()

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return super().sharding_types(compute_device_type) + list(PGAS_SHARDING_TYPES)

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ShardedPgasEmbeddingBagCollection:
        _check_ranks_agree(module, params, env, self._pgas_options, self.fused_params, device)
        return ShardedPgasEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
            pgas_options=self._pgas_options,
        )
