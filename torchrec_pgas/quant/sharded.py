"""The sharded quantized ``EmbeddingBagCollection``, its sharder, and
``shard_quant_model``, the entry point for a model served one process per rank.

TorchRec serves quantized tables with ``shard_quant_model``, one process driving
every GPU. Here each rank is a process, as on the float path under
``DistributedModelParallel``: a batch's ids go by one-sided puts to the owner of each
table (``TwExchange``, the float path's table-wise exchange), the owner pools them
with the very module TorchRec serves unsharded (a ``QuantEmbeddingBagCollection`` of
its own tables, whose FBGEMM int-N kernel dequantizes each row), and puts the pooled
rows back. Each bag is pooled by the same kernel over the same rows in the same order
as unsharded, so the output equals the unsharded module's bit for bit.

Tables may instead be served ``pgas_row_wise`` (``RwExchange``): every rank holds
the row block TorchRec's ``row_wise`` gives it, pools it with the same kernel, and
the requester adds the owners' partial sums in rank order. Those sums are the
unsharded ones up to fp32 rounding (other order of additions), not bit for bit.

A module on a GPU is served one process per GPU by the float path's GPU exchanges
(``DeviceTwExchange``, ``DeviceRwExchange``: NVSHMEM puts from Triton kernels). The
owner receives its lookup groups as fixed-shape tensors (``world * batch_capacity``
bags per feature, those past a source's batch empty; ``GroupIds``) and pools them with the same FBGEMM
modules, called directly: TorchRec's quantized forward would split the KJT by reading
its lengths back to the host, which a step on GPUs never does (so it can be captured
in a CUDA graph, ``torchrec_pgas.graphs.capture``). Each bag is still pooled by the
same kernel over the same rows in the same order, so table-wise output equals the
unsharded module's on the same GPU bit for bit. As on the float path, a bad batch is
found on the device and raised on every rank at the start of a later forward (or by
``torchrec_pgas.graphs.raise_errors(model, wait=True)``), its step's output NaN.

On a world of one GPU there is nobody to exchange with: tables that are all
table-wise, in one FBGEMM module, are served by that module's lookup alone
(``local.py``, under the same contract), as TorchRec serves a world of one.
"""

import copy
import dataclasses
import functools
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_pgas.kernels.ids_slot import Capacity
from torchrec_pgas.planner import make_planner
from torchrec_pgas.quant.local import LocalServing
from torchrec_pgas.sharding.agreement import check_ranks_agree, table_description
from torchrec_pgas.sharding.base import PgasShardingMixin
from torchrec_pgas.sharding.batch_checks import first_batch_problem, input_problem, module_batch_problem, send_problem
from torchrec_pgas.sharding.dists import PgasPooledEmbeddingDist, send_ids
from torchrec_pgas.sharding.exchange import Exchange, HostBatch, LookupInput, PooledLookup, raise_errors
from torchrec_pgas.sharding.rw_exchange import RwExchange
from torchrec_pgas.sharding.tw_base import PgasInputError, TwFeature, dense_batch, feature_rows
from torchrec_pgas.sharding.tw_exchange import TwExchange
from torchrec_pgas.transport import get_transport
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE, PgasOptions

# Where a table goes: the rank that holds it whole, or ``PGAS_ROW_WISE`` (a row
# block on every rank).
Placement = Union[int, str]


def _lookup_order(tables: Sequence[EmbeddingBagConfig]) -> List[EmbeddingBagConfig]:
    """``tables`` in the order a ``QuantEmbeddingBagCollection`` of them pools and
    outputs them: grouped by pooling (one FBGEMM module per group), groups in order of
    first appearance. Building the owner's module in this order makes its feature and
    output order the exchange's."""
    groups: Dict[object, List[EmbeddingBagConfig]] = defaultdict(list)
    for t in tables:
        groups[(t.pooling, getattr(t, "use_virtual_table", False))].append(t)
    return [t for group in groups.values() for t in group]


def _table_weights(module: QuantEmbeddingBagCollection) -> Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Each table's quantized rows and scale/bias as FBGEMM stores them (the
    ``table_name_to_quantized_weights`` TorchRec builds a module from)."""
    out: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
    for tables, tbe in zip(module._key_to_tables.values(), module._emb_modules):
        for table, (weight, scale_shift) in zip(tables, tbe.split_embedding_weights(split_scale_shifts=True)):
            out[table.name] = (weight, scale_shift)
    return out


def balanced_owners(tables: Sequence[EmbeddingBagConfig], world_size: int) -> Dict[str, int]:
    """A table -> rank placement that balances the rows times dims each rank holds
    (largest table first, onto the least loaded rank); the same on every rank."""
    load = [0] * world_size
    owners: Dict[str, int] = {}
    for t in sorted(tables, key=lambda t: (-t.num_embeddings * t.embedding_dim, t.name)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[t.name] = rank
        load[rank] += t.num_embeddings * t.embedding_dim
    return owners


def _check_plan(
    module: QuantEmbeddingBagCollection,
    configs: Sequence[EmbeddingBagConfig],
    owners: Mapping[str, Placement],
    world_size: int,
) -> None:
    """Raises unless ``owners`` places every table of ``module`` on a rank of the world
    or row-wise over it, each of a row-wise table's row blocks has rows, and the module
    is one this path serves (on the CPU or a GPU)."""
    problems = sorted(set(t.name for t in configs) ^ set(owners))
    if problems:
        raise ValueError(f"{PGAS_TABLE_WISE}: owners must name every table of the module once; differ: {problems}")
    bad = {
        t: r
        for t, r in owners.items()
        if r != PGAS_ROW_WISE and not (isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size)
    }
    if bad:
        raise ValueError(
            f"{PGAS_TABLE_WISE}: owners {bad} are neither ranks of a world of {world_size} nor {PGAS_ROW_WISE!r}"
        )
    empty = [t.name for t in configs if owners[t.name] == PGAS_ROW_WISE and 0 in _row_blocks(t, world_size)]
    if empty:
        raise ValueError(
            f"{PGAS_ROW_WISE}: tables {empty} leave a rank without rows (ceil(rows / {world_size}) per rank); "
            "place them on one rank instead"
        )
    pruned = [t.name for t in configs if t.num_embeddings_post_pruning is not None]
    if pruned:
        # Their ids go through FBGEMM's remapping, which the owners' checks and
        # lookups here do not apply.
        raise ValueError(f"{PGAS_TABLE_WISE}: pruned tables (num_embeddings_post_pruning) are not served: {pruned}")
    if module.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"{PGAS_TABLE_WISE}: quantized tables are served on CPU or CUDA ranks, not {module.device}"
        )


def _row_blocks(table: EmbeddingBagConfig, world_size: int) -> List[int]:
    """The rows each rank holds of ``table`` under TorchRec's ``row_wise``:
    ``ceil(rows / world)`` each, the last ranks what is left."""
    block = -(-table.num_embeddings // world_size)
    return [max(0, min(block, table.num_embeddings - r * block)) for r in range(world_size)]


def _output_columns(
    configs: Sequence[EmbeddingBagConfig], blocks: Sequence[Sequence[EmbeddingBagConfig]], keys: Sequence[str]
) -> Tuple[List[int], Optional[torch.Tensor]]:
    """The width of each output key, and the gather of columns (None if none is
    needed) that restores the unsharded module's order of ``keys``: the exchanges put
    each block of tables (in ``blocks`` order) side by side."""
    names_by_table = dict(zip([t.name for t in configs], get_embedding_names_by_table(configs)))
    dim_by_name = {n: t.embedding_dim for t in configs for n in names_by_table[t.name]}
    sharded_names = [n for tables in blocks for t in tables for n in names_by_table[t.name]]
    starts, col = {}, 0
    for n in sharded_names:
        starts[n], col = col, col + dim_by_name[n]
    order = [c for n in keys for c in range(starts[n], starts[n] + dim_by_name[n])]
    return [dim_by_name[n] for n in keys], None if order == list(range(col)) else torch.tensor(order, dtype=torch.int64)


def _local_module(
    module: QuantEmbeddingBagCollection,
    tables: Sequence[EmbeddingBagConfig],
    weights: Mapping[str, Tuple[torch.Tensor, Optional[torch.Tensor]]],
    device: torch.device,
) -> Optional[QuantEmbeddingBagCollection]:
    """TorchRec's own quantized module (FBGEMM's int-N kernel) of ``tables`` on
    ``device``, built from ``weights`` (quantized rows, scale/bias) cut from the
    unsharded module's.

    On a GPU its FBGEMM modules skip their bounds check: the GPU exchange's index
    tensors have the ids slots' capacity, longer than the bags, and FBGEMM's check
    would stretch the last bag over the rest; every id was checked by its source."""
    if not tables:
        return None
    local = QuantEmbeddingBagCollection(
        tables=list(tables),
        is_weighted=module.is_weighted(),
        device=device,
        output_dtype=module.output_dtype(),
        table_name_to_quantized_weights={t.name: weights[t.name] for t in tables},
        row_alignment=module.row_alignment,
    )
    if device.type == "cuda":
        for tbe in local._emb_modules:
            tbe.bounds_check_mode_int = BoundsCheckMode.NONE.value
    return local


def _distinct_features(
    tables: List[EmbeddingBagConfig],
) -> Tuple[List[EmbeddingBagConfig], Optional[List[str]]]:
    """``tables`` with feature names that no two tables share, and those names in
    order (None if they shared none, and ``tables`` are returned as they are).

    The owner's batch on CPU ranks has a key per table reading a feature, and
    TorchRec's quantized module takes a feature's ids by its name: the first of two
    same-named keys for both tables, which row-wise buckets per table differently."""
    names = [f for t in tables for f in t.feature_names]
    if len(set(names)) == len(names):
        return tables, None
    renamed = [dataclasses.replace(t, feature_names=[f"{t.name}.{f}" for f in t.feature_names]) for t in tables]
    return renamed, [f for t in renamed for f in t.feature_names]


def _group_sizes(tables: Sequence[EmbeddingBagConfig]) -> List[int]:
    """The number of features of each FBGEMM module of a ``QuantEmbeddingBagCollection``
    of ``tables`` (in ``_lookup_order``): the GPU exchange's lookup groups."""
    sizes: Dict[object, int] = defaultdict(int)
    for t in tables:
        sizes[(t.pooling, getattr(t, "use_virtual_table", False))] += t.num_features()
    return list(sizes.values())


class _NBitLookup:
    """FBGEMM's int-N lookup of one module of an owner's ``QuantEmbeddingBagCollection``
    (``tbe``), as the module's forward makes it for the modules ``_local_module``
    builds: the same operator with the same arguments, without the forward's host
    steps that do nothing for them (moving inputs already on the module's device, an
    index remapping and a row cache they do not have, a bounds check they skip, the
    queue of cache locations never filled), which would otherwise run at every step.

    A module that has any of those, or hooks, is called as a module; so is one whose
    attributes differ from those this was written against (another FBGEMM)."""

    def __init__(self, tbe: nn.Module) -> None:
        self.tbe = tbe
        self._key: Optional[Tuple[Any, ...]] = None
        self._args: Optional[Dict[str, Any]] = None  # None: called as a module

    def __call__(self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        tbe = self.tbe
        state = tbe.__dict__
        # Rebuilt if the module's tensors or settings were replaced (``_apply``, an
        # assignment): what it reads is what the module would read now.
        key = (
            tuple(map(id, tbe._buffers.values())),
            id(state.get("weights_dev")),
            id(state.get("weights_host")),
            id(state.get("weights_uvm")),
            state.get("bounds_check_mode_int"),
            state.get("_report_input_params"),
            bool(tbe._forward_hooks or tbe._forward_pre_hooks),
        )
        if key != self._key:
            self._args, self._key = _nbit_args(tbe), key
        args = self._args
        if args is None or _global_module_hooks():
            return tbe(indices=indices, offsets=offsets, per_sample_weights=weights)
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            indices=indices, offsets=offsets, indice_weights=weights, **args
        )


def _global_module_hooks() -> bool:
    """Whether hooks registered for every module would run at a module's call."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _nbit_args(tbe: nn.Module) -> Optional[Dict[str, Any]]:
    """The arguments, other than the batch, of the int-N operator that ``tbe``'s
    forward calls, if that forward does nothing else for this module; else None."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen as TBE

    cls = type(tbe)
    if not isinstance(tbe, TBE) or cls.forward is not TBE.forward or cls._forward_impl is not TBE._forward_impl:
        return None
    try:
        plain = (
            getattr(tbe, "_report_input_params", None) is None
            and tbe.weight_initialized
            and tbe.bounds_check_mode_int == BoundsCheckMode.NONE.value
            and tbe.index_remapping_hash_table_cpu is None
            and tbe.index_remapping_hash_table.numel() == 0
            and tbe.index_remappings_array.numel() == 0
            and tbe.lxu_cache_weights.numel() == 0
            and not (tbe._forward_hooks or tbe._forward_pre_hooks)
        )
        if not plain:
            return None
        device = tbe.bounds_check_warning.device
        return dict(
            dev_weights=tbe.weights_host if tbe.host_size > 0 else tbe.weights_dev,
            uvm_weights=tbe.weights_uvm,
            weights_placements=tbe.weights_placements,
            weights_offsets=tbe.weights_offsets,
            weights_tys=tbe.weights_tys,
            D_offsets=tbe.D_offsets,
            total_D=tbe.total_D,
            max_int2_D=tbe.max_int2_D,
            max_int4_D=tbe.max_int4_D,
            max_int8_D=tbe.max_int8_D,
            max_float16_D=tbe.max_float16_D,
            max_float32_D=tbe.max_float32_D,
            pooling_mode=int(tbe.pooling_mode),
            output_dtype=tbe.output_dtype,
            lxu_cache_weights=tbe.lxu_cache_weights,
            # What the forward pops from its queue of cache locations when none was
            # pushed (only a prefetch pushes, for a row cache).
            lxu_cache_locations=torch.full((0,), -1, dtype=torch.int32, device=device),
            row_alignment=tbe.row_alignment,
            max_float8_D=tbe.max_float8_D,
            fp8_exponent_bits=tbe.fp8_exponent_bits,
            fp8_exponent_bias=tbe.fp8_exponent_bias,
        )
    except AttributeError:
        return None


def _pool_groups(
    local: QuantEmbeddingBagCollection,
    groups: Sequence[Any],
    weighted: bool,
    lookups: Optional[Sequence[_NBitLookup]] = None,
) -> torch.Tensor:
    """The pooled rows of the GPU exchange's lookup groups (one per FBGEMM module of
    ``local``, in its order; KJTs or ``GroupIds``), side by side: ``local``'s forward without its split of
    the batch by feature, which reads the lengths back to the host. ``lookups``:
    ``local``'s modules as ``_NBitLookup``s (default: called as modules).

    The ids and offsets go in as the exchange lays them out, int64: FBGEMM's int-N
    kernel takes int32 or int64 (TorchRec's forward casts to int32, two more launches
    per step) and pools the same rows in the same order either way."""
    calls = lookups if lookups is not None else [_as_module(tbe) for tbe in local._emb_modules]
    outs = [call(kjt.values(), kjt.offsets(), kjt.weights() if weighted else None) for call, kjt in zip(calls, groups)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _without_weights(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``kjt`` without its per-sample weights (same ids, lengths and batch size)."""
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), stride=kjt.stride())


def _as_module(tbe: nn.Module) -> Any:
    return lambda indices, offsets, weights: tbe(indices=indices, offsets=offsets, per_sample_weights=weights)


class _ServedExchange(PgasShardingMixin):
    """One exchange of a ``PgasQuantEmbeddingBagCollection``, listed in its
    ``_embedding_shardings`` as a sharded TorchRec module lists its PGAS shardings:
    ``torchrec_pgas.graphs`` (``capture``, ``raise_errors``) finds a model's exchanges
    there. Only ``exchange`` is meant to be read."""

    def __init__(self, exchange: Exchange) -> None:  # noqa: D107 - no sharding to set up
        self._exchange = exchange


class PgasQuantEmbeddingBagCollection(nn.Module):
    """A ``QuantEmbeddingBagCollection`` sharded ``pgas_table_wise`` and/or
    ``pgas_row_wise``: same input (a KJT of the module's features), same output (a
    ``KeyedTensor``, keys and columns in the unsharded module's order), each table
    placed by ``owners`` (table name -> rank holding it whole, or ``"pgas_row_wise"``:
    every rank holds the row block TorchRec's ``row_wise`` gives it).

    Table-wise tables go through a ``TwExchange`` (``DeviceTwExchange`` for a module
    on a GPU) and equal the unsharded module's output bit for bit. Row-wise tables go
    through an ``RwExchange`` (``DeviceRwExchange``): each owner pools its rows with
    FBGEMM's int-N kernel and the requester adds the partial sums in rank order, so
    their sums differ from FBGEMM's single pass by rounding (fp32 additions in another
    order), not exactly equal.

    Every rank of ``pg`` must build it from the same module (the same tables and
    weights, on the CPU or on its own GPU) with the same ``owners`` and ``options``,
    and call it for every batch: like the float path, a step is collective. A bad
    batch on any rank (unknown features, ids out of a table's range, negative
    lengths, missing per-sample weights) raises the same ``PgasInputError`` on every
    rank, and the next batch is served normally. On CPU ranks the step that had it
    raises; on GPUs nothing waits for the device, as on the float path: the bad step's
    output is NaN on every rank, and every rank raises at the start of a later
    forward, or at ``torchrec_pgas.graphs.raise_errors(model, wait=True)``.

    ``plan_problem``: what the caller found wrong with this rank's plan (no owners
    then): refused on every rank, with the check that the ranks' tables agree.
    """

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        owners: Mapping[str, Placement],
        pg: dist.ProcessGroup,
        options: Optional[PgasOptions] = None,
        *,
        plan_problem: Optional[str] = None,
    ) -> None:
        super().__init__()
        options = options or PgasOptions()
        world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
        configs = module.embedding_bag_configs()
        problem = plan_problem
        if problem is None:
            try:
                _check_plan(module, configs, owners, world_size)
            except (ValueError, NotImplementedError) as e:
                problem = str(e)
        # Every rank takes part, its plan valid or not: a rank that raised alone would
        # leave its peers in this collective.
        output = f", output {module.output_dtype()}"
        tables = [table_description(t, module.is_weighted(), f"on {owners.get(t.name)!r}{output}") for t in configs]
        check_ranks_agree(options, tables, pg, PGAS_TABLE_WISE, problem)
        self._is_weighted = module.is_weighted()
        self._out_dtype = module.output_dtype()
        device = module.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._pg = pg
        transport = get_transport(pg, device, options)
        if transport.device.type != device.type:
            raise ValueError(
                f"{PGAS_TABLE_WISE}: a quantized module on {device} needs a transport on it; "
                f"PgasOptions(transport={options.transport!r}) gave one on {transport.device}"
            )
        weights = _table_weights(module)
        # (exchange, its input features in order, this rank's pooling module)
        self._parts: List[Tuple[TwExchange, List[str], str]] = []
        self.local: Optional[QuantEmbeddingBagCollection] = None
        self.local_row_wise: Optional[QuantEmbeddingBagCollection] = None
        blocks: List[List[EmbeddingBagConfig]] = []
        # The keys each pooling module is given its batch under on CPU ranks, where
        # they differ from the exchange's (``_distinct_features``).
        self._pool_keys: Dict[str, Optional[List[str]]] = {}

        per_rank = [_lookup_order([t for t in configs if owners[t.name] == r]) for r in range(world_size)]
        if any(per_rank):
            features_per_rank = [
                [TwFeature(name=f, table=t.name, num_embeddings=t.num_embeddings) for t in ts for f in t.feature_names]
                for ts in per_rank
            ]
            exchange = self._make_exchange(
                TwExchange,
                transport,
                _group_sizes(per_rank[rank]),
                features_per_rank=features_per_rank,
                dim_sum_per_rank=[sum(t.embedding_dim * t.num_features() for t in ts) for ts in per_rank],
                out_dtype=self._out_dtype,
                capacity=Capacity.of(options),
                name=PGAS_TABLE_WISE,
            )
            mine_tw, self._pool_keys["local"] = _distinct_features(copy.deepcopy(per_rank[rank]))
            self.local = _local_module(module, mine_tw, weights, device)
            self._parts.append((exchange, [f.name for fs in features_per_rank for f in fs], "local"))
            blocks.extend(per_rank)

        row_wise = [t for t in configs if owners[t.name] == PGAS_ROW_WISE]
        if row_wise:
            rows = {t.name: _row_blocks(t, world_size) for t in row_wise}
            features = [TwFeature(f, t.name, t.num_embeddings) for t in row_wise for f in t.feature_names]
            # This rank's row block of each table, pooled by sum: the exchange divides
            # the whole sum for mean tables (partial means could not be added).
            start = {t.name: sum(rows[t.name][:rank]) for t in row_wise}
            mine = [
                dataclasses.replace(copy.deepcopy(t), num_embeddings=rows[t.name][rank], pooling=PoolingType.SUM)
                for t in row_wise
            ]
            exchange = self._make_exchange(
                RwExchange,
                transport,
                _group_sizes(mine),
                features=features,
                local_rows=[[rows[f.table][r] for f in features] for r in range(world_size)],
                dims=[t.embedding_dim for t in row_wise for _ in t.feature_names],
                mean=[t.pooling == PoolingType.MEAN for t in row_wise for _ in t.feature_names],
                # FBGEMM's int-N kernels divide a weighted bag by its number of ids.
                mean_by_count=True,
                out_dtype=self._out_dtype,
                capacity=Capacity.of(options),
                name=PGAS_ROW_WISE,
            )
            block_weights = {
                t.name: tuple(
                    w[start[t.name] : start[t.name] + t.num_embeddings] if w is not None else None
                    for w in weights[t.name]
                )
                for t in mine
            }
            mine, self._pool_keys["local_row_wise"] = _distinct_features(mine)
            self.local_row_wise = _local_module(module, mine, block_weights, device)  # type: ignore[arg-type]
            self._parts.append((exchange, [f.name for f in features], "local_row_wise"))
            blocks.append(row_wise)

        # The float path's output dist: puts the pooled rows, and divides the summed
        # rows of row-wise mean tables (``MeanAfterSum``'s divisor) once they are summed.
        self._output_dists = [
            PgasPooledEmbeddingDist(exchange, PGAS_ROW_WISE if name == "local_row_wise" else PGAS_TABLE_WISE)
            for exchange, _, name in self._parts
        ]
        self._configs = list(configs)
        self._keys = list(module._embedding_names)
        self._length_per_key, columns = _output_columns(configs, blocks, self._keys)
        self._columns = columns.to(device) if columns is not None else None
        # GPUs: each pooling module's FBGEMM lookups (``_pool``), by the module's id.
        self._lookups: Dict[int, List[_NBitLookup]] = {}
        # A world of one GPU serves batches in the lookup's feature order with no
        # exchange (``local.py``); whether they come so is seen at the first batch.
        self._local_serving = self._make_local_serving(world_size)
        self._use_local: Optional[bool] = None if self._local_serving is not None else False
        # Where ``torchrec_pgas.graphs`` finds the exchanges (CUDA graphs, deferred errors).
        self._embedding_shardings = [_ServedExchange(exchange) for exchange, _, _ in self._parts]
        if self._local_serving is not None:
            self._embedding_shardings.append(_ServedExchange(self._local_serving))  # type: ignore[arg-type]
        self._served: List[Any] = [s.exchange for s in self._embedding_shardings]
        self._needed = list(dict.fromkeys(f for _, keys, _ in self._parts for f in keys))
        self._feature_rows = feature_rows(configs)
        self._batch_keys: Optional[List[str]] = None
        self._permutes: Dict[Tuple[int, Tuple[str, ...]], List[int]] = {}
        # GPUs: whether batches go to every exchange whole (decided on the first).
        self._direct: Optional[bool] = None if device.type == "cuda" else False

    def _make_exchange(
        self, host_type: Type[TwExchange], transport: object, group_sizes: List[int], **args: object
    ) -> TwExchange:
        """``host_type`` (``TwExchange``, ``RwExchange``) of ``args`` on the host
        transport, its GPU counterpart on NVSHMEM's. The GPU one hands the owner its
        lookup groups' tensors (``fused_lookup=False``: its own pooling kernel reads
        float rows, not quantized ones), whose index tensors FBGEMM reads only as far
        as the bags go (``_local_module`` turns its bounds check off)."""
        if self._device.type != "cuda":
            return host_type(transport=transport, **args)  # type: ignore[arg-type]
        from torchrec_pgas.sharding.rw_device_exchange import DeviceRwExchange
        from torchrec_pgas.sharding.tw_device_exchange import DeviceTwExchange

        device_type = DeviceRwExchange if host_type is RwExchange else DeviceTwExchange
        return device_type(  # type: ignore[return-value]
            transport=transport,
            group_sizes=group_sizes,
            weighted=self._is_weighted,
            lookup_reads_only_bags=True,
            fused_lookup=False,
            group_tensors=True,  # ``_pool`` calls FBGEMM itself, right after the receive
            **args,
        )

    def _make_local_serving(self, world_size: int) -> Optional[LocalServing]:
        """``LocalServing`` of this rank's tables if the module is on a world of one GPU
        and they are all table-wise, in one FBGEMM module (one pooling), each feature
        read by one table, none without rows; else None (the exchanges serve it)."""
        local = self.local
        if world_size != 1 or self._device.type != "cuda" or local is None or self.local_row_wise is not None:
            return None
        configs = _lookup_order(self._configs)
        features = [TwFeature(f, t.name, t.num_embeddings) for t in configs for f in t.feature_names]
        if len(local._emb_modules) != 1 or len({f.name for f in features}) != len(features):
            return None
        if any(t.num_embeddings < 1 for t in configs):
            return None  # a bad id is looked up as row 0, which such a table lacks
        assert self._columns is None, "one rank's tables in one FBGEMM module are output in the module's order"
        return LocalServing(
            _NBitLookup(local._emb_modules[0]),
            features,
            sum(self._length_per_key),
            self._out_dtype,
            self._is_weighted,
            self._device,
            PGAS_TABLE_WISE,
        )

    def _serve_locally(self, features: KeyedJaggedTensor) -> bool:
        """Whether ``LocalServing`` serves this batch: decided at the first batch that
        has the module's features, by their order (the exchanges take any order). A
        batch without them is served (and reported) by it until then."""
        if self._use_local is not None:
            return self._use_local
        local = self._local_serving
        if local is None or not isinstance(features, KeyedJaggedTensor):
            return False
        keys = list(features.keys())
        if sorted(keys) != sorted(local.keys):
            return True
        self._use_local = keys == local.keys
        # A step asks only what serves (or has served: its errors may be pending).
        kept = [
            s
            for s in self._embedding_shardings
            if (s.exchange is local) == self._use_local or any(s.exchange.step_counters())
        ]
        self._embedding_shardings, self._served = kept, [s.exchange for s in kept]
        return self._use_local

    @property
    def _exchanges(self) -> List[TwExchange]:
        return [exchange for exchange, _, _ in self._parts]

    def _problem(self, features: KeyedJaggedTensor) -> Optional[str]:
        problem = module_batch_problem(features, self._batch_keys, self._needed)
        if problem is None and self._is_weighted and features.weights_or_none() is None:
            problem = "per-sample weights are missing: the module's tables are weighted"
        if problem is None and features.variable_stride_per_key():
            # Refused before its split by feature, which may fail on this rank alone.
            problem = "batch size varies per feature (VBE), which the PGAS sharding types do not serve"
        return problem

    def _adopt_input_order(self, features: KeyedJaggedTensor) -> bool:
        """On GPUs, at the first batch, collectively: whether batches go whole to
        every exchange from now on, in this batch's feature order, each exchange
        picking and checking its features on the device (no permute, which reads the
        lengths back to the host): if every rank's batch has the module's features, in
        the same order, and every exchange can route that order. Else every batch
        takes the host's checks and permutes (as on CPU ranks), which synchronize.
        A first batch that fails TorchRec's validation on some rank raises on every
        rank, sending nothing (the next batch decides again): it would also size the
        buffers for good."""
        eligible = isinstance(features, KeyedJaggedTensor) and not features.variable_stride_per_key()
        keys = list(features.keys()) if eligible else None
        invalid = None
        if keys is not None and len(set(keys)) != len(keys):
            invalid = f"features {keys} name a feature twice"
        elif eligible and input_problem(features) is None:
            invalid = first_batch_problem(features, self._configs)
        everyone: List[Any] = [None] * dist.get_world_size(self._pg)
        dist.all_gather_object(everyone, (keys, invalid), group=self._pg)
        errors = [f"rank {r} sent an invalid KJT: {e}" for r, (_, e) in enumerate(everyone) if e]
        if errors:
            raise PgasInputError("; ".join(errors))
        if keys is None or any(k != keys for k, _ in everyone) or set(keys) != set(self._needed):
            return False
        if not all(x.takes_input_order(keys) for x in self._exchanges):
            return False
        for x in self._exchanges:
            adopted = x.adopt_input_order(keys, self._feature_rows)
            assert adopted, "an exchange refused the input order it said it takes"
        return True

    def _send(self, features: KeyedJaggedTensor) -> List[int]:
        """Sends each exchange its features of ``features``, or, if the batch cannot be
        served, its problem in their place: then every rank raises for this step."""
        if self._direct is None:
            self._direct = self._adopt_input_order(features)
        if self._direct:
            # Each exchange checks the whole batch on the device and sends its problem,
            # if any, in its place.
            return [send_ids(exchange, features) for exchange in self._exchanges]
        problem = self._problem(features)
        if problem is not None:
            return [
                send_problem(exchange, features, problem, keys, lambda kjt, e=exchange: send_ids(e, kjt))
                for exchange, keys, _ in self._parts
            ]
        keys = features.keys()
        if self._batch_keys is None:
            self._batch_keys = list(keys)
        features = dense_batch(features)
        steps = []
        for i, (exchange, wanted, _) in enumerate(self._parts):
            send = functools.partial(send_ids, exchange)
            try:
                part = features
                if keys != wanted:
                    perm = self._permutes.setdefault((i, tuple(keys)), [keys.index(f) for f in wanted])
                    part = features.permute(perm)
            except Exception as e:  # noqa: BLE001 - sent as the step's problem, raised on every rank
                steps.append(send_problem(exchange, features, f"features cannot be split ({e})", wanted, send))
                continue
            steps.append(send(part))
        return steps

    def _pool(
        self, local: Optional[QuantEmbeddingBagCollection], batch: LookupInput, keys: Optional[List[str]] = None
    ) -> torch.Tensor:
        """This owner's pooled rows of every source's bags of ``batch`` (in the
        exchange's lookup order), by ``local`` (None: the rank owns none), whose
        features are ``keys`` if given (the batch's, renamed in order)."""
        if isinstance(batch, HostBatch):
            if local is None:
                return torch.empty(batch.kjt.stride(), 0, dtype=self._out_dtype)
            kjt = batch.kjt
            if keys is not None:
                kjt = KeyedJaggedTensor(
                    keys=keys,
                    values=kjt.values(),
                    lengths=kjt.lengths(),
                    weights=kjt.weights_or_none(),
                    stride=kjt.stride(),
                )
            return local(kjt).values()
        if local is None:
            return torch.empty(batch.stride(), 0, dtype=self._out_dtype, device=self._device)
        lookups = self._lookups.get(id(local))
        if lookups is None or [x.tbe for x in lookups] != list(local._emb_modules):
            # Once per pooling module (its FBGEMM modules' lookups keep their arguments).
            lookups = self._lookups[id(local)] = [_NBitLookup(tbe) for tbe in local._emb_modules]
        return _pool_groups(local, batch.groups, self._is_weighted, lookups)  # type: ignore[attr-defined]

    @torch.no_grad()
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pools ``features``: the unsharded module's output, from this rank's batch."""
        # What earlier steps reported on GPUs, before any of this step's sends: never
        # in the middle of a step (nothing on the host exchanges, which raise in the
        # step that had it).
        raise_errors(self._served)
        if isinstance(features, KeyedJaggedTensor) and features.device() != self._device:
            # The unsharded module takes a batch on any device (FBGEMM moves it).
            features = features.to(self._device, non_blocking=True)
        if (
            isinstance(features, KeyedJaggedTensor)
            and not self._is_weighted
            and features.weights_or_none() is not None
            and not features.variable_stride_per_key()  # refused as such
        ):
            # Ignored, as the unsharded module ignores them: its tables are unweighted.
            features = _without_weights(features)
        if self._serve_locally(features):
            out = self._local_serving(features)  # type: ignore[misc]
            return KeyedTensor(keys=self._keys, length_per_key=self._length_per_key, values=out)
        steps = self._send(features)
        # Every exchange takes its step, even after another's raised, so that all
        # stay in step for the next batch.
        batches: List[LookupInput] = []
        error: Optional[Exception] = None
        for (exchange, _, _), step in zip(self._parts, steps):
            try:
                batches.append(exchange.recv_ids(step))
            except Exception as e:  # noqa: BLE001 - raised below, once every exchange has its step
                error = error or e
        if error is not None:
            raise error
        outs = []
        for (_, _, local_name), output_dist, batch in zip(self._parts, self._output_dists, batches):
            embs = self._pool(getattr(self, local_name), batch, self._pool_keys.get(local_name))
            # (A row-wise mean's fp32 divisor would promote fp16 or bf16 rows.)
            outs.append(output_dist.pooled(PooledLookup(embs, batch.route)).to(self._out_dtype))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self._columns is not None:
            out = out.index_select(1, self._columns)
        return KeyedTensor(keys=self._keys, length_per_key=self._length_per_key, values=out)


class PgasQuantEmbeddingBagCollectionSharder(QuantEmbeddingBagCollectionSharder):
    """TorchRec's sharder of ``QuantEmbeddingBagCollection`` (same shardable
    parameters and kernels, so TorchRec's plans and planner apply), offering
    ``pgas_table_wise`` and ``pgas_row_wise`` (a row block on every rank, laid out as
    TorchRec's ``row_wise``) to TorchRec's planner. A planner handed this sharder
    directly picks between the two for every table; ``plan_quant_model`` keeps
    tables table-wise (bit for bit) unless their constraints ask for row-wise."""

    def __init__(self, options: Optional[PgasOptions] = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._pgas_options = options or PgasOptions()

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [PGAS_TABLE_WISE, PGAS_ROW_WISE]

    def shard(  # type: ignore[override]
        self,
        module: QuantEmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: Union[ShardingEnv, Dict[str, ShardingEnv]],
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> PgasQuantEmbeddingBagCollection:
        if not isinstance(env, ShardingEnv) or env.process_group is None:
            raise ValueError(f"{PGAS_TABLE_WISE}: a ShardingEnv with the process group of every rank is needed")
        owners, problem = _plan_placement(params, module.embedding_bag_configs(), env.world_size)
        return PgasQuantEmbeddingBagCollection(
            module, owners, env.process_group, self._pgas_options, plan_problem=problem
        )

    @property
    def module_type(self) -> Type[QuantEmbeddingBagCollection]:
        return QuantEmbeddingBagCollection


def _plan_placement(
    params: Optional[Mapping[str, ParameterSharding]], configs: Sequence[EmbeddingBagConfig], world_size: int
) -> Tuple[Dict[str, Placement], Optional[str]]:
    """``_plan_owners``, or no owners and what is wrong with the plan (``params`` None:
    the plan has no entry for the module), for the module to refuse on every rank."""
    if params is None:
        return {}, "the plan has no entry for this module"
    try:
        return _plan_owners(params, configs, world_size), None
    except ValueError as e:
        return {}, str(e)


def _plan_owners(
    params: Mapping[str, ParameterSharding], configs: Sequence[EmbeddingBagConfig], world_size: int
) -> Dict[str, Placement]:
    """table name -> placement from one module's plan: the rank of a
    ``pgas_table_wise`` table, ``PGAS_ROW_WISE`` for a ``pgas_row_wise`` one.

    The module cuts a row-wise table's blocks itself (``_row_blocks``), so a plan
    whose ranks or row shards say otherwise (one made for another world size, or by
    a planner laying row-wise out differently) would be served other than it reads:
    it is refused instead."""
    served = (PGAS_TABLE_WISE, PGAS_ROW_WISE)
    wrong = {t: p.sharding_type for t, p in params.items() if p.sharding_type not in served}
    if wrong:
        raise ValueError(f"{PGAS_TABLE_WISE}: this sharder serves only {list(served)} tables, not {wrong}")
    tables = {t.name: t for t in configs}
    for name, p in sorted(params.items()):
        if p.sharding_type == PGAS_ROW_WISE and name in tables:
            _check_row_wise_sharding(tables[name], p, world_size)
    return {
        t: PGAS_ROW_WISE if p.sharding_type == PGAS_ROW_WISE else int((p.ranks or [0])[0]) for t, p in params.items()
    }


def _check_row_wise_sharding(table: EmbeddingBagConfig, p: ParameterSharding, world_size: int) -> None:
    """Raises unless ``p`` puts ``table``'s rows on every rank in the blocks of
    TorchRec's ``row_wise`` (the ones ``_row_blocks`` cuts): rank r holds rows
    ``[sum(blocks[:r]), sum(blocks[:r + 1]))``, whole (every column of the quantized
    rows, whose width the planner counts in bytes, not embedding dims)."""
    every_rank = list(range(world_size))
    if p.ranks is not None and list(p.ranks) != every_rank:
        raise ValueError(
            f"{PGAS_ROW_WISE}: table {table.name!r} is planned on ranks {list(p.ranks)}; "
            f"a row-wise table has a row block on every rank of the world, {every_rank}"
        )
    if p.sharding_spec is None:
        return
    shards = p.sharding_spec.shards  # type: ignore[attr-defined]
    blocks = _row_blocks(table, world_size)
    expected = [(r, sum(blocks[:r]), blocks[r]) for r in every_rank]
    found = sorted(
        (s.placement.rank() if s.placement is not None else -1, s.shard_offsets[0], s.shard_sizes[0]) for s in shards
    )
    whole_rows = all(s.shard_offsets[1] == 0 for s in shards) and len({s.shard_sizes[1] for s in shards}) == 1
    if found != expected or not whole_rows:
        raise ValueError(
            f"{PGAS_ROW_WISE}: table {table.name!r}'s plan has shards (offsets, sizes) "
            f"{[(s.shard_offsets, s.shard_sizes) for s in shards]} on ranks {[r for r, _, _ in found]}; "
            f"TorchRec's row_wise over {world_size} ranks gives (rank, first row, rows) {expected}, whole rows"
        )


def _quant_modules(model: nn.Module) -> List[Tuple[str, QuantEmbeddingBagCollection]]:
    if isinstance(model, QuantEmbeddingBagCollection):
        raise ValueError("shard_quant_model shards submodules: wrap the QuantEmbeddingBagCollection in a module")
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantEmbeddingBagCollection)]
    others = [f"{n} ({type(m).__name__})" for n, m in found if type(m) is not QuantEmbeddingBagCollection]
    if others:
        # Their feature processors or id remapping would be dropped by the PGAS module.
        raise ValueError(
            f"shard_quant_model serves QuantEmbeddingBagCollection only, not its subclasses: {', '.join(others)}"
        )
    return found


def _check_constraints(
    model: nn.Module,
    constraints: Mapping[str, ParameterConstraints],
    sharder: PgasQuantEmbeddingBagCollectionSharder,
) -> None:
    """Raises unless every constraint names a quantized table of ``model`` and only
    sharding types and kernels ``sharder`` offers. Checked on every rank before rank 0
    plans: TorchRec's planner reports these on rank 0 alone ("No available sharding
    type and compute kernel combination", not naming the type), and drops a type it
    cannot use silently when another is listed beside it."""
    tables = {t.name for _, m in _quant_modules(model) for t in m.embedding_bag_configs()}
    unknown = sorted(set(constraints) - tables)
    if unknown:
        raise ValueError(f"constraints name tables {unknown} that no QuantEmbeddingBagCollection of the model has")
    types = sharder.sharding_types("cpu")
    for name, c in sorted(constraints.items()):
        bad_types = [t for t in c.sharding_types or [] if t not in types]
        if bad_types:
            raise ValueError(
                f"ParameterConstraints for quantized table {name!r} name sharding type(s) {bad_types}; "
                f"{type(sharder).__name__} offers {types}"
            )
        kernels = sorted({k for t in types for k in sharder.compute_kernels(t, "cpu")})
        bad_kernels = [k for k in c.compute_kernels or [] if k not in kernels]
        if bad_kernels:
            raise ValueError(
                f"ParameterConstraints for quantized table {name!r} name compute kernel(s) {bad_kernels}; "
                f"{type(sharder).__name__} offers {kernels}"
            )


def _planner_constraints(
    model: nn.Module, constraints: Mapping[str, ParameterConstraints], world_size: int
) -> Dict[str, ParameterConstraints]:
    """The constraints the planner gets: ``constraints``, with every quantized table
    whose constraint names no sharding type kept ``pgas_table_wise``, and
    ``pgas_row_wise`` taken out for tables too small to give every rank rows.

    Row-wise output is the unsharded module's only up to fp32 rounding, table-wise
    output is it bit for bit, so row-wise is served where a constraint asks for it,
    never by default. A table of fewer rows than a row block per rank would leave a
    rank without rows, which the sharded module refuses; the planner would not know.

    Raises:
        ValueError: a constraint allows only ``pgas_row_wise`` for such a table.
    """
    out = dict(constraints)
    for _, m in _quant_modules(model):
        for t in m.embedding_bag_configs():
            c = constraints.get(t.name) or ParameterConstraints()
            types = list(c.sharding_types or [PGAS_TABLE_WISE])
            if PGAS_ROW_WISE in types and 0 in _row_blocks(t, world_size):
                types.remove(PGAS_ROW_WISE)
                if not types:
                    raise ValueError(
                        f"ParameterConstraints for quantized table {t.name!r} allow only {PGAS_ROW_WISE}, but its "
                        f"{t.num_embeddings} rows leave a rank of {world_size} without rows "
                        f"(ceil(rows / {world_size}) per rank); allow {PGAS_TABLE_WISE} too"
                    )
            out[t.name] = dataclasses.replace(c, sharding_types=types)
    return out


def plan_quant_model(
    model: nn.Module,
    pg: dist.ProcessGroup,
    constraints: Optional[Mapping[str, ParameterConstraints]] = None,
    topology: Optional[Topology] = None,
    options: Optional[PgasOptions] = None,
) -> ShardingPlan:
    """TorchRec's ``EmbeddingShardingPlanner`` plan for the ``QuantEmbeddingBagCollection``
    modules of ``model`` under ``PgasQuantEmbeddingBagCollectionSharder`` (kernel
    ``quant``, storage from the quantized rows), honouring ``constraints`` (table name
    -> ``ParameterConstraints``). A table is planned ``pgas_row_wise`` only where its
    constraint's ``sharding_types`` name it (with ``pgas_table_wise`` beside it, the
    planner's cost model picks); tables naming no type are planned
    ``pgas_table_wise``. ``topology`` defaults to ``pg``'s ranks as CPU devices.
    Collective, as ``EmbeddingShardingPlanner.collective_plan``: rank 0 plans and
    broadcasts; bad constraints, and any planner failure, raise on every rank.

    Raises:
        ValueError: a constraint names a table no quantized module has, a sharding
            type or kernel the quant sharder does not offer, or only
            ``pgas_row_wise`` for a table with fewer rows than that needs.
        RuntimeError: the planner found no plan (its message, on every rank).
    """
    sharder = PgasQuantEmbeddingBagCollectionSharder(options=options)
    _check_constraints(model, constraints or {}, sharder)
    world_size = dist.get_world_size(pg)
    planned = _planner_constraints(model, constraints or {}, world_size)
    topology = topology or Topology(world_size=world_size, compute_device="cpu")
    if topology.world_size != world_size:
        raise ValueError(f"topology has {topology.world_size} ranks, the process group {world_size}")
    planner = make_planner(topology, planned)
    result: List[object] = [None]
    if dist.get_rank(pg) == 0:
        try:
            result[0] = planner.plan(model, [sharder])  # type: ignore[list-item]
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            result[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(result, src=dist.get_global_rank(pg, 0), group=pg)
    if not isinstance(result[0], ShardingPlan):
        raise RuntimeError(f"planning the quantized tables failed on rank 0: {result[0]}")
    return result[0]


def shard_quant_model(
    model: nn.Module,
    pg: dist.ProcessGroup,
    owners: Optional[Mapping[str, Placement]] = None,
    options: Optional[PgasOptions] = None,
    *,
    plan: Optional[ShardingPlan] = None,
    constraints: Optional[Mapping[str, ParameterConstraints]] = None,
    topology: Optional[Topology] = None,
) -> nn.Module:
    """Replaces, in place, every ``QuantEmbeddingBagCollection`` of ``model`` (the
    output of TorchRec's ``quantize_embeddings``) by its ``pgas_table_wise`` and/or
    ``pgas_row_wise`` sharding over ``pg``; returns ``model``, whose forward is unchanged. The placement, one of:
    ``owners`` (table name -> rank, or ``"pgas_row_wise"`` for a row block on every
    rank, for the tables of every such module); ``plan`` (a TorchRec ``ShardingPlan``
    keyed by module path, ``pgas_table_wise`` and/or ``pgas_row_wise``);
    ``constraints`` and/or ``topology`` (planned by ``plan_quant_model``); none
    (``balanced_owners`` per module). Collective: every rank of ``pg`` calls it with
    the same model and placement."""
    planned = constraints is not None or topology is not None
    if sum((owners is not None, plan is not None, planned)) > 1:
        raise ValueError("shard_quant_model: give at most one of owners, plan, constraints/topology")
    targets = _quant_modules(model)
    if planned:
        plan = plan_quant_model(model, pg, constraints, topology, options)
    world_size = dist.get_world_size(pg)
    for name, m in targets:
        names = {t.name for t in m.embedding_bag_configs()}
        problem = None
        if plan is not None:
            params = plan.get_plan_for_module(name)
            placed, problem = _plan_placement(params, m.embedding_bag_configs(), world_size)  # type: ignore[arg-type]
            problem = problem and f"module {name!r}: {problem}"
        elif owners is not None:
            placed = {t: r for t, r in owners.items() if t in names}
        else:
            placed = balanced_owners(m.embedding_bag_configs(), world_size)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        # Every rank builds the module, its plan valid or not: it refuses a plan that
        # any rank could not take on every rank, in one collective.
        setattr(parent, attr, PgasQuantEmbeddingBagCollection(m, placed, pg, options, plan_problem=problem))
    return model
