"""The owner's training step without FBGEMM's backward: the lookup pools straight from
the ids slots (``lookup_put``, as in inference) and the backward applies the tables'
fused optimizer itself: the forward keys and sorts the ids by row (``kernels/update_keys``,
a stable sort, ``kernels/sort_order``; or on GPUs, where the rows fit int32 and the ids
are unweighted, FBGEMM's ``transpose_embedding_input`` with ``kernels/transpose_bags``
and ``kernels/transposed_ids``), the backward steps the rows (``kernels/step_verdict``,
``kernels/row_update``, ``kernels/run_groups``, ``kernels/run_update``).

FBGEMM's fused backward sorts its whole index tensor, so under autograd the owner's
index tensor had to hold exactly the batch's ids, whose count the host then read back:
one synchronization per training step, and a step no CUDA graph could capture. The
update here reads an index tensor of fixed capacity and only the batch's ids in it, so
a training step enqueues device work only. It covers what TorchRec's fused tables
usually are, and keeps FBGEMM's path (``FusedUpdate.groups`` returns None) for the
rest: ``EXACT_SGD`` and ``EXACT_ROWWISE_ADAGRAD`` (weight decay none, L2 or decoupled;
no max-norm or gradient clipping) over fp32 weights wholly in device memory, and no
mean pooling of weighted bags. Results equal FBGEMM's to fp32 rounding (the order of
additions differs), and a bad step updates nothing (see ``row_update``).

The hyper-parameters (learning rate, eps, weight decay) are FBGEMM's module's: the
kernels read them from a small device tensor per group, which an eager backward brings
up to date (a write only when one changed) and a CUDA graph's replay too, before it
runs (``refresh``: it also takes the learning rate of the tables' fused optimizer, as
that optimizer's ``zero_grad()`` or ``step()`` would). A schedule stepped between
replays then reaches them as it reaches eager steps that call the optimizer's
``zero_grad()`` before the backward (a schedule advanced inside the captured function,
as ``WarmupOptimizer`` does, is not run by a replay); as launch arguments, a graph
would keep its capture's values.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.launch import strided_rows
from torchrec_pgas.kernels.row_step import HYPER_WORDS, ROWWISE_ADAGRAD, SGD, StepRule
from torchrec_pgas.kernels.row_update import partial_shape, row_update
from torchrec_pgas.kernels.run_groups import run_groups, sums_shape
from torchrec_pgas.kernels.run_update import run_update
from torchrec_pgas.kernels.sort_order import sort_order
from torchrec_pgas.kernels.step_verdict import step_verdict
from torchrec_pgas.kernels.transpose_bags import transpose_bags
from torchrec_pgas.kernels.transposed_ids import transposed_ids
from torchrec_pgas.kernels.update_keys import key_dtype, packs, update_keys

_OPTIMS = {EmbOptimType.EXACT_SGD: SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD: ROWWISE_ADAGRAD}
#: FBGEMM's weight decay modes the update applies: none, L2, decoupled.
_WEIGHT_DECAY_MODES = (0, 1, 2)


@dataclass
class GroupUpdate:
    """What one lookup group's update reads: its FBGEMM module, per feature its
    table's first row, gradient column and mean pooling (``features``, int64 [F, 3], see
    ``kernels/update_keys``), per table with rows its first row, weights offset, dim and
    optimizer state offset (``tables``, int64 [T, 4], by first row, see
    ``kernels/sort_order``), its count of rows (its keys are below it) and their sort
    keys' dtype, its fused optimizer
    (TorchRec's, whose ``param_groups`` hold the learning rate a schedule sets; None if
    the lookup has none), the hyper-parameters the kernels read (``hyper``, float32
    [HYPER_WORDS], see ``kernels/row_step``) with the values last written there, and
    where its ids take FBGEMM's ``transpose_embedding_input`` (``transpose_sort``), the
    op's ``hash_size_cumsum`` (``transposed``, int64 [F + 2]: each feature's first row,
    then the extra feature's, ``rows``, and the end; see ``kernels/transpose_bags``)."""

    tbe: SplitTableBatchedEmbeddingBagsCodegen
    features: torch.Tensor
    tables: torch.Tensor
    optim: int
    max_dim: int
    rows: int
    keys: torch.dtype
    mean: bool
    optimizer: Optional[torch.optim.Optimizer]
    hyper: torch.Tensor
    transposed: Optional[torch.Tensor] = None
    written: Tuple[float, ...] = ()

    def hyper_parameters(self) -> Tuple[float, ...]:
        """The learning rate, eps and weight decay FBGEMM's module holds now, as its
        fused backward reads them (none but the learning rate for ``EXACT_SGD``)."""
        args, adagrad = self.tbe.optimizer_args, self.optim == ROWWISE_ADAGRAD
        lr = self.tbe.get_learning_rate()
        return (float(lr), float(args.eps) if adagrad else 0.0, float(args.weight_decay) if adagrad else 0.0)

    def write_hyper_parameters(self) -> None:
        """Brings ``hyper`` up to date: a write (per changed word, enqueued on the
        current stream) only where a value changed since the last."""
        values = self.hyper_parameters()
        for word, value in enumerate(values):
            if not self.written or self.written[word] != value:
                self.hyper[word : word + 1].fill_(value)
        self.written = values


def _qualifies(tbe: Any, weighted: bool) -> bool:
    if not isinstance(tbe, SplitTableBatchedEmbeddingBagsCodegen) or tbe.optimizer not in _OPTIMS:
        return False
    args = tbe.optimizer_args
    return (
        tbe.weights_dev.dtype == torch.float32
        and tbe.weights_dev.numel() > 0
        and not (tbe.weights_uvm.numel() or tbe.weights_host.numel())
        and not (weighted and tbe.pooling_mode == PoolingMode.MEAN)
        and tbe.pooling_mode in (PoolingMode.SUM, PoolingMode.MEAN)
        and not args.gradient_clipping
        and getattr(args, "max_norm", 0.0) == 0.0
        # FBGEMM's hook that keeps only an id's first occurrence (this update sums them).
        and not getattr(tbe, "use_writeback_bwd_prehook", False)
        and (
            tbe.optimizer == EmbOptimType.EXACT_SGD
            or (
                int(args.weight_decay_mode) in _WEIGHT_DECAY_MODES
                and tbe.momentum1_dev.dtype == torch.float32
                and tbe.momentum1_dev.numel() > 0
            )
        )
    )


def row_tables(tbe: SplitTableBatchedEmbeddingBagsCodegen) -> List[List[int]]:
    """``sort_order``'s ``tables`` for ``tbe``: per table that has rows, by first row (in
    the group's rows: FBGEMM's ``hash_size_cumsum``), its first row, weights offset,
    dim and row-wise optimizer state offset (0 without one); one row of zeros when no
    table has rows (no key then needs one). Features that share a table share its
    first row, and a table without rows shares it with the next table."""
    dims, at = tbe.D_offsets.tolist(), tbe.weights_offsets.tolist()
    first_rows = tbe.hash_size_cumsum.tolist()
    adagrad = tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    state = tbe.momentum1_offsets.tolist() if adagrad else [0] * len(at)
    tables = {
        first_rows[f]: [first_rows[f], at[f], dims[f + 1] - dims[f], state[f]]
        for f, table in enumerate(tbe.feature_table_map)
        if tbe.embedding_specs[table][0] > 0
    }
    return [tables[r] for r in sorted(tables)] or [[0, 0, 0, 0]]


def sort_positions(keys: torch.Tensor, rows: int) -> torch.Tensor:
    """The stable sort's permutation of ``keys`` (int32), whose values are at most
    ``rows``: FBGEMM's radix sort of row indices, which passes over only the bits
    ``rows`` needs and moves int32 positions (``torch.sort`` passes over every bit of
    the dtype and moves int64 positions)."""
    if keys.numel() >= torch.iinfo(torch.int32).max:
        raise ValueError(f"a lookup group's index tensor holds {keys.numel()} ids: the sort takes fewer than 2**31 - 1")
    return torch.ops.fbgemm.get_unique_indices_with_inverse(keys, rows, False, True)[3]


def transpose_info_bits(features: int, bags_per_feature: int) -> Optional[int]:
    """The low bits of FBGEMM's infos that hold a bag (the rest hold its feature) for a
    group of ``features`` features (and the extra one of ``kernels/transpose_bags``) of
    ``bags_per_feature`` bags each, or None if the infos, int32 and read as signed by
    ``kernels/transposed_ids``, cannot hold both."""
    bits = max(1, (bags_per_feature - 1).bit_length())
    return bits if (features + 1) << bits < 2**31 else None


def transpose_sort(
    transposed: torch.Tensor, rows: int, offsets: torch.Tensor, indices: torch.Tensor, bags_per_feature: int, bits: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stable sort of a group's row keys by FBGEMM's ``transpose_embedding_input``:
    the sorted keys (``rows`` past the batch's ids) and each one's feature and bag
    (``feature << bits | bag``), both int32 [N], and the offsets the op was given
    (``kernels/transpose_bags``, which zeroes ``indices``, int32, past the ids;
    ``offsets`` start at 0). The op
    keys, sorts and run-length encodes in one call (the runs are not used): TorchRec's
    backward sorts its ids the same way."""
    offsets_out = torch.empty(offsets.numel() + bags_per_feature, dtype=torch.int32, device=indices.device)
    transpose_bags(offsets, indices, offsets_out, bags_per_feature)
    _, keys, infos, *_ = torch.ops.fbgemm.transpose_embedding_input(
        transposed, max(1, rows.bit_length()), indices, offsets_out, False, None, bits, (1 << bits) - 1
    )
    return keys, infos, offsets_out


@dataclass
class SortedIds:
    """One lookup group's ids of a step as its update reads them (``prepare``): the
    stable sort of their row keys, and in that order each one's gradient row (an offset
    in the gradient, rows of the pitch ``prepare`` was given), scale and table (its row
    of ``GroupUpdate.tables``; see ``kernels/update_keys`` and ``kernels/sort_order``)."""

    keys: torch.Tensor
    src: torch.Tensor
    scale: torch.Tensor
    table_index: torch.Tensor


class FusedUpdate:
    """The owner's fused sparse update of its lookup modules (see the module
    docstring). ``enabled`` goes False for good when a module does not qualify."""

    def __init__(self, enabled: bool, weighted: bool, device: torch.device) -> None:
        self.enabled = enabled
        self._weighted, self._dev = weighted, device
        self._tbes: List[Any] = []
        self._groups: List[GroupUpdate] = []
        self._no_weights = torch.empty(1, dtype=torch.float32, device=device)

    def groups(self, emb_modules: Sequence[Any]) -> Optional[List[GroupUpdate]]:
        """Per lookup group, what its update reads; None if some group does not
        qualify (then FBGEMM's backward runs, as before)."""
        if not self.enabled:
            return None
        tbes = [getattr(m, "emb_module", None) for m in emb_modules]
        if len(tbes) == len(self._tbes) and all(t is u for t, u in zip(tbes, self._tbes)):
            return self._groups
        if not all(_qualifies(t, self._weighted) for t in tbes):
            self.enabled = False
            return None
        groups, col = [], 0
        for m, t in zip(emb_modules, tbes):
            dims, first_rows = t.D_offsets.tolist(), t.hash_size_cumsum.tolist()
            mean = int(t.pooling_mode == PoolingMode.MEAN)
            width = [dims[f + 1] - dims[f] for f in range(len(dims) - 1)]
            features = [[first_rows[f], col + dims[f], mean] for f in range(len(width))]
            rows = int(t.total_hash_size)
            groups.append(
                GroupUpdate(
                    tbe=t,
                    features=torch.tensor(features, dtype=torch.int64, device=self._dev),
                    tables=torch.tensor(row_tables(t), dtype=torch.int64, device=self._dev),
                    optim=_OPTIMS[t.optimizer],
                    max_dim=max(width),
                    rows=rows,
                    keys=key_dtype(rows),
                    mean=bool(mean),
                    optimizer=getattr(m, "fused_optimizer", None),
                    hyper=torch.zeros(HYPER_WORDS, dtype=torch.float32, device=self._dev),
                    transposed=self._transposed(first_rows, rows),
                )
            )
            col += dims[-1]
        self._tbes, self._groups = tbes, groups
        return groups

    def _transposed(self, first_rows: List[int], rows: int) -> Optional[torch.Tensor]:
        """``GroupUpdate.transposed`` for a group whose features' tables start at
        ``first_rows`` (FBGEMM's ``hash_size_cumsum``, ``rows`` last), or None where
        its ids take the other sort: FBGEMM's op runs on GPUs only, reads int32 ids
        only where every row fits int32, and keeps no per-sample weights."""
        if self._dev.type != "cuda" or self._weighted or key_dtype(rows) != torch.int32:
            return None
        return torch.tensor(first_rows + [rows], dtype=torch.int64, device=self._dev)

    def ids_dtype(self, groups: Sequence[GroupUpdate]) -> torch.dtype:
        """The dtype of the index tensors ``prepare`` reads: int32 where every group's
        rows fit it (its ids, checked to lie in their tables, then do too), which
        ``transpose_sort`` needs and which halves the copy of the ids."""
        return torch.int32 if all(g.keys == torch.int32 for g in groups) else torch.int64

    def refresh(self) -> None:
        """Before a CUDA graph's replay: each group's learning rate from its fused
        optimizer's ``param_groups`` into FBGEMM's module, as the optimizer's
        ``zero_grad()`` in an eager step puts it there, then the hyper-parameters the
        kernels read."""
        for group in self._groups:
            if group.optimizer is not None:
                group.tbe.set_learning_rate(group.optimizer.param_groups[0]["lr"])
            group.write_hyper_parameters()

    def _scaled(self, group: GroupUpdate) -> bool:
        """Whether the group's gradient rows are scaled (per-sample weights, mean pooling)."""
        return self._weighted or group.mean

    def prepare(
        self, groups: Sequence[GroupUpdate], kjts: Sequence[KeyedJaggedTensor], bags_per_feature: int, pitch: int
    ) -> List[SortedIds]:
        """Keys and sorts each group's ids of one step (``kjts``: its lookup groups' ids,
        index tensors of fixed capacity) for the update of its backward, whose lookup
        output's gradient will be ``[bags_per_feature, pitch]``, rows contiguous. Enqueued
        in the forward, right after the lookup: the device sorts while the host runs the
        rest of the step, and the backward enqueues only the update itself."""
        prepared = []
        for group, kjt in zip(groups, kjts):
            indices, offsets = kjt.values(), kjt.offsets()
            n, scaled, dev = indices.numel(), self._scaled(group), indices.device
            bits = transpose_info_bits(group.features.size(0), bags_per_feature)
            if group.transposed is not None and indices.dtype == torch.int32 and bits is not None:
                keys, infos, offsets_out = transpose_sort(
                    group.transposed, group.rows, offsets, indices, bags_per_feature, bits
                )
                ids = self._sorted_ids(n, keys.dtype, scaled, dev)
                transposed_ids(
                    keys,
                    infos,
                    offsets_out,
                    group.features,
                    group.tables,
                    ids.keys,
                    ids.src,
                    ids.scale,
                    ids.table_index,
                    group.rows,
                    bags_per_feature,
                    pitch,
                    bits,
                    scaled,
                )
                prepared.append(ids)
                continue
            packed = packs(group.keys, bags_per_feature, pitch)
            keys = torch.empty(n, dtype=group.keys, device=dev)
            src = torch.empty(n, dtype=torch.int64, device=dev)
            scale = torch.empty(n, dtype=torch.float32, device=dev) if scaled else self._no_weights
            update_keys(
                offsets,
                indices,
                kjt.weights() if self._weighted else self._no_weights,
                group.features,
                keys,
                src,
                scale,
                bags_per_feature,
                pitch,
                group.rows,
                scaled,
                self._weighted,
                packed,
            )
            order = sort_positions(keys, group.rows)
            ids = self._sorted_ids(n, keys.dtype, scaled, dev)
            sort_order(
                keys,
                order,
                group.rows,
                offsets,
                src,
                scale,
                group.tables,
                ids.keys,
                ids.src,
                ids.scale,
                ids.table_index,
                scaled,
                packed,
            )
            prepared.append(ids)
        return prepared

    def _sorted_ids(self, n: int, keys: torch.dtype, scaled: bool, device: torch.device) -> SortedIds:
        """The arrays of ``n`` sorted positions either sort fills (``keys`` their keys'
        dtype; a scale per position only if ``scaled``)."""
        return SortedIds(
            torch.empty(n, dtype=keys, device=device),
            torch.empty(n, dtype=torch.int64, device=device),
            torch.empty(n, dtype=torch.float32, device=device) if scaled else self._no_weights,
            torch.empty(n, dtype=torch.int32, device=device),
        )

    def apply(
        self,
        groups: Sequence[GroupUpdate],
        prepared: Sequence[SortedIds],
        grad: torch.Tensor,
        pitch: int,
        record: torch.Tensor,
        err: torch.Tensor,
        num_sources: int,
    ) -> None:
        """Applies each group's update for one step: ``prepared`` are its sorted ids
        (``prepare``, given ``pitch``), ``grad`` the gradient of the owner's lookup output,
        ``record`` the step's record and ``err`` the transport's error record."""
        if not prepared:
            return
        if grad.dim() != 2 or grad.shape[1] != pitch:
            raise ValueError(f"the lookup output's gradient is {list(grad.shape)}, expected rows of {pitch}")
        grad = strided_rows(grad)  # a column slice of the module's gradient is read where it is
        verdict = torch.empty(1, dtype=torch.int64, device=grad.device)
        step_verdict(record, err, verdict, num_sources)
        # Not while a graph is captured: a write recorded there would put the capture's
        # values back at every replay, after ``refresh`` wrote the replay's.
        capturing = grad.is_cuda and torch.cuda.is_current_stream_capturing()
        for group, ids in zip(groups, prepared):
            tbe, n = group.tbe, ids.keys.numel()
            partial = torch.empty(partial_shape(n, group.max_dim), dtype=torch.float32, device=grad.device)
            sums = torch.empty(sums_shape(n, group.max_dim), dtype=torch.float32, device=grad.device)
            adagrad = group.optim == ROWWISE_ADAGRAD
            state = tbe.momentum1_dev if adagrad else self._no_weights
            rule = StepRule(group.optim, int(tbe.optimizer_args.weight_decay_mode) if adagrad else 0)
            if not capturing:
                group.write_hyper_parameters()
            row_update(
                ids.keys,
                ids.src,
                ids.scale,
                ids.table_index,
                group.tables,
                grad,
                pitch,
                tbe.weights_dev,
                state,
                partial,
                verdict,
                group.hyper,
                group.max_dim,
                rule,
                self._scaled(group),
            )
            run_groups(ids.keys, partial, sums, group.max_dim)
            run_update(
                ids.keys,
                ids.table_index,
                group.tables,
                tbe.weights_dev,
                state,
                partial,
                sums,
                verdict,
                group.hyper,
                group.max_dim,
                rule,
            )


@dataclass
class PendingUpdate:
    """One step's update, applied by the backward of its lookup output (``output``):
    the owner's lookup groups' sorted ids of the step (``prepared``) and its record."""

    update: FusedUpdate
    groups: List[GroupUpdate]
    prepared: List[SortedIds]
    pitch: int  # of the lookup output's gradient rows, as ``prepare`` was given it
    record: torch.Tensor
    err: torch.Tensor  # the transport's error record
    num_sources: int

    def output(self, stand_in: torch.Tensor) -> torch.Tensor:
        """The lookup output of the step: ``stand_in`` (the output's shape; its rows
        were put already), whose gradient applies the update."""
        anchor = torch.empty(0, device=stand_in.device, requires_grad=True)
        return _UpdateInBackward.apply(anchor, stand_in, self)

    def apply(self, grad: torch.Tensor) -> None:
        self.update.apply(self.groups, self.prepared, grad, self.pitch, self.record, self.err, self.num_sources)


class _UpdateInBackward(torch.autograd.Function):
    """Forward: the stand-in of the lookup output; backward: the step's update (the
    tables are not autograd parameters: their optimizer is fused, as FBGEMM's)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, stand_in: torch.Tensor, pending: PendingUpdate) -> torch.Tensor:  # type: ignore[override]
        ctx.pending = pending
        return stand_in.view_as(stand_in)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        ctx.pending.apply(grad)
        # The graph node outlives its backward (as long as the loss does): the sorted ids
        # would otherwise stay next to the next step's.
        ctx.pending = None
        return None, None, None
