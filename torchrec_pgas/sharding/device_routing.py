"""What differs between the GPU exchanges of the sharding types, given to
``DeviceTwExchange``'s constructor: how ids are routed to their owners
(``TableWiseIds``, ``RowBlockIds``), and where owners store pooled rows in a
requester's output slot (``OutputBlocks``); then the per-rank address tables that
follow from both and the buffers (``PeerTables``)."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.kernels.grads_put import PUT_DEST_WORDS
from torchrec_pgas.kernels.ids_header import runs_of
from torchrec_pgas.kernels.row_buckets import row_buckets
from torchrec_pgas.sharding.tw_base import InputRouting
from torchrec_pgas.transport.device_buffers import DeviceBuffers

Routed = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]

#: The most runs of consecutive features an owner's part of a batch may take: each run
#: is three of ``put_signal``'s unrolled puts. A batch order that scatters an owner's
#: features more goes TorchRec's way (permuted into the sharding's order).
MAX_RUNS = 8

#: The rows ``RowBlockIds`` takes the tables of a batch's other features to have: all
#: their ids (checked against their real tables) fall in bucket 0's block, and the
#: kernel's ``block * world`` stays an int64.
OTHER_ROWS = 1 << 62


def per_owner(counts: Sequence[int], pos: Sequence[int]) -> List[List[int]]:
    """``pos`` (per input feature of the sharding, owner by owner) cut into each
    owner's part, ``counts[w]`` features for owner ``w``."""
    starts = [sum(counts[:w]) for w in range(len(counts))]
    return [list(pos[s : s + c]) for s, c in zip(starts, counts)]


class IdsRouting(InputRouting, Protocol):
    """Which owner gets which of a batch's ids (``TableWiseIds``, ``RowBlockIds``),
    and which batches it can route (``InputRouting``)."""

    def route(self, kjt: KeyedJaggedTensor, values, offsets, lengths, weights) -> Routed:
        """The batch's ``values, offsets, lengths, weights`` with each owner's part
        contiguous, owner by owner (``routed_features`` says where)."""

    def unrouted(self, offsets: torch.Tensor, lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Offsets and lengths in the routed layout for a batch that is not routed."""

    def routed_features(self, owner: int, input_pos: Sequence[int]) -> List[int]:
        """Where owner ``owner``'s features, in its lookup's order, are in the routed
        batch (``input_pos``: where each of the sharding's input features is in the
        batches given, see ``adopt_input_order``)."""


class TableWiseIds:
    """Table-wise routing: each owner's features are contiguous in the batch already
    (TorchRec orders the sharding's features by rank), or where ``adopt_input_order``
    put them; ``counts[w]`` is the number of features of owner ``w``."""

    def __init__(self, counts: Sequence[int]) -> None:
        self._counts = list(counts)

    def route(self, kjt: KeyedJaggedTensor, values, offsets, lengths, weights) -> Routed:
        """The batch as it is routed (here: as given)."""
        return values, offsets, lengths, weights

    def unrouted(self, offsets: torch.Tensor, lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Offsets and lengths in the routed layout for a batch that is not routed (it
        goes as a bare header; only sizes are read from it)."""
        return offsets, lengths

    def routed_features(self, owner: int, input_pos: Sequence[int]) -> List[int]:
        """Where owner ``owner``'s features, in the order its lookup takes them, are in
        the routed batch."""
        return per_owner(self._counts, input_pos)[owner]

    def routable(self, input_pos: Sequence[int], num_keys: Optional[int] = None) -> bool:
        """Any batch whose parts per owner take at most ``MAX_RUNS`` runs (other
        features of the batch are in no owner's part)."""
        return all(len(runs_of(part)) <= MAX_RUNS for part in per_owner(self._counts, input_pos))


class RowBlockIds:
    """Row-wise routing: ids bucketed by row block on the device (``row_buckets``),
    every feature of the batch as it is given, so no permute reads the lengths back.
    Owner ``r`` gets bucket ``r`` of the sharding's features, ids local to its block:
    in a batch of ``F'`` features, routed features ``r * F' + input_pos[i]`` for the
    sharding's feature ``i`` (``adopt_input_order``; by default the batch is the
    sharding's ``F`` features in order). ``block_sizes``: int64 [F], rows per block of
    each of the sharding's features' tables."""

    def __init__(self, block_sizes: torch.Tensor, world_size: int) -> None:
        # Read once, at set-up: ``routable`` compares them on the host.
        self._own_sizes: List[int] = block_sizes.tolist()
        self._world = world_size
        self._num_keys = len(self._own_sizes)
        self._block_sizes = block_sizes  # per feature of the batch

    def adopt_input_order(self, input_pos: Sequence[int], num_keys: int) -> None:
        """Routes batches of ``num_keys`` features where the sharding's feature ``i``
        is at ``input_pos[i]`` (``routable``). The other features' ids go to bucket 0
        whole (``OTHER_ROWS``: ``row_buckets`` needs a block for every feature), and no
        owner is sent that: bucketing them is the only work they cost."""
        assert self.routable(input_pos, num_keys), (list(input_pos), num_keys)
        sizes = [OTHER_ROWS // self._world] * num_keys
        for p, size in zip(input_pos, self._own_sizes):
            sizes[p] = size
        self._block_sizes = torch.tensor(sizes, dtype=torch.int64, device=self._block_sizes.device)
        self._num_keys = num_keys

    def route(self, kjt: KeyedJaggedTensor, values, offsets, lengths, weights) -> Routed:
        """Bad ids land in some bucket (FBGEMM hashes ids past the blocks), but such a
        batch is sent as its header alone."""
        # Nothing to bucket; or one owner, whose bucket is the batch as it is (every
        # id in its block, local ids the ids, ids past a table too: ``id // 1``).
        if kjt.stride() == 0 or self._world == 1:
            return values, offsets, lengths, weights
        return row_buckets(values, offsets, weights, self._block_sizes, self._world)

    def unrouted(self, offsets: torch.Tensor, lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """As if every id went to owner 0: in range of the routed layout (``W`` times
        the batch's bags), and the first batch sizes the slots by all its ids."""
        rest = (self._world - 1) * lengths.numel()
        return (
            torch.cat([offsets, offsets[-1:].expand(rest)]),
            torch.cat([lengths, lengths.new_zeros(rest)]),
        )

    def routed_features(self, owner: int, input_pos: Sequence[int]) -> List[int]:
        return [owner * self._num_keys + p for p in input_pos]

    def routable(self, input_pos: Sequence[int], num_keys: Optional[int] = None) -> bool:
        """Any batch whose sharding features take at most ``MAX_RUNS`` runs (each
        owner's part has the same runs, in its own bucket), where a feature that
        several of the sharding's tables pool has the same row blocks in each (the
        batch has one bucketing of it)."""
        block_at: Dict[int, int] = {}
        for p, size in zip(input_pos, self._own_sizes):
            if block_at.setdefault(p, size) != size:
                return False
        return len(runs_of(input_pos)) <= MAX_RUNS


@dataclass(frozen=True)
class OutputBlocks:
    """Where owners store pooled rows in a requester's output slot, ``[blocks, rows,
    dim]``: table-wise, one block, each owner at its columns ``col_offsets[o]``; row-
    wise, one block per owner (``my_block``: this rank's) of full-width partial sums,
    which the requester's ``output_take`` adds in rank order."""

    blocks: int
    my_block: int
    dim: int
    col_offsets: Sequence[int]


class PeerTables:
    """The per-rank address tables of the kernels, built once: every small tensor op
    is host time on the critical path of a step.

    * ``out_addrs[g]``: int64 [W], where this rank's block starts in each requester's
      output slot of generation ``g``; ``my_counts``: int64 [W], word ``me`` of each
      requester's ``out_count``.
    * ``out_free_words``: int64 [owners], word ``me`` of each table owner's
      ``out_free``; ``ids_free_words``: int64 [W], word ``me`` of each source's
      ``ids_free`` (``output_take`` releases both).
    * ``grad_dests``: int64 [owners, 5], per table owner ``o``: ``o``, its first
      column, its columns, where this rank's rows start in its gradient slots, and
      word ``me`` of its ``grads_count`` (``grads_put``).

    With ``put_path`` (some peer is served by NVSHMEM puts, ``DeviceBuffers.put_path``)
    the kernels take their put-path tables instead, where such a peer's addresses
    through the mapping are 0 and the put needs its PE and symmetric addresses (this
    rank's address of the same symmetric word: NVSHMEM translates it): ``out_addrs[g]``
    is ``[rows_put.PUT_ROWS, W]`` (those addresses, PEs, symmetric output blocks,
    symmetric counter words, this rank's staging part for each requester),
    ``out_free_words`` and ``ids_free_words`` are ``[output_take.PUT_ROWS, n]``
    (addresses, PEs, symmetric free words) and ``grad_dests`` is ``[owners,
    grads_put.PUT_DEST_WORDS]`` (the five words, then the owner's PE, the symmetric
    gradient slot and counter word, and this rank's staging part for the owner).
    Without it the tables are exactly the ones above, so the kernels compile and run
    as if the put path did not exist.
    """

    def __init__(
        self,
        buffers: DeviceBuffers,
        output: OutputBlocks,
        owners: Sequence[int],
        dims: Sequence[int],
        me: int,
        elem: int,
    ) -> None:
        dev, rows, world = buffers.ids.device, buffers.sizes.rows, len(buffers.out_free_peers)
        self.put_path = put = buffers.put_path
        pes = list(range(world))
        word = 8 * me

        def sym(t: torch.Tensor, offset: int) -> List[int]:
            return [t.data_ptr() + offset] * world

        def staging(t: Optional[torch.Tensor], part: int) -> List[int]:
            return [t.data_ptr() + q * part if t is not None else 0 for q in pes]

        mine = output.my_block * rows * output.dim * elem
        out_peers, count_peers = buffers.out.peers.tolist(), buffers.out_count.peers.tolist()
        out_staging = staging(buffers.out_staging, buffers.out_staging_bytes)
        self.out_addrs: List[torch.Tensor] = []
        for g in range(buffers.depth):
            at = g * buffers.out_slot_bytes + mine
            table = [_offset(out_peers, at), pes, sym(buffers.out.local, at), sym(buffers.out_count.local, word)]
            self.out_addrs.append(_table(table + [out_staging], put, dev))
        self.my_counts = torch.tensor(_offset(count_peers, word), dtype=torch.int64, device=dev)

        def free_words(peers: List[int], sig: torch.Tensor, whose: Sequence[int]) -> torch.Tensor:
            table = [_offset([peers[q] for q in whose], word), list(whose), [sig.data_ptr() + word] * len(whose)]
            return _table(table, put, dev)

        self.out_free_words = free_words(buffers.out_free_peers, buffers.out_free, owners)
        self.ids_free_words = free_words(buffers.ids_free_peers, buffers.ids_free, pes)
        grads, counts = buffers.grads.peers.tolist(), buffers.grads_count.peers.tolist()
        grads_sym, counts_sym = buffers.grads.local.data_ptr(), buffers.grads_count.local.data_ptr()
        grad_staging = staging(buffers.grad_staging, buffers.grad_staging_bytes)
        dests = []
        for o in owners:
            at = me * rows * dims[o] * elem
            mapped = _offset([grads[o]], at) + _offset([counts[o]], word)
            dests.append(
                [o, output.col_offsets[o], dims[o], *mapped, o, grads_sym + at, counts_sym + word, grad_staging[o]]
            )
        table = torch.tensor(dests, dtype=torch.int64, device=dev).view(-1, PUT_DEST_WORDS)
        self.grad_dests = table if put else table[:, :5].contiguous()


def _offset(addrs: Sequence[int], offset: int) -> List[int]:
    """``addrs`` moved by ``offset`` bytes, but 0 (no peer mapping) stays 0."""
    return [a + offset if a else 0 for a in addrs]


def _table(rows: List[List[int]], put_path: bool, device: torch.device) -> torch.Tensor:
    """The put-path table of ``rows`` (contiguous int64), or only its first row (the
    addresses through the peer mapping) without the put path."""
    table = torch.tensor(rows, dtype=torch.int64, device=device)
    return table if put_path else table[0].clone()


def first_batch_sizes(
    batch_size: int,
    offsets: torch.Tensor,
    routed: Sequence[Sequence[int]],
    group: dist.ProcessGroup,
    device: torch.device,
) -> Tuple[int, int, int]:
    """The largest batch size, ids per owner and ids per owner and sample (rounded up) of
    any rank's first batch (collective: the set-up's read of the first batch's sizes;
    the set-up also reads address tables back once)."""
    ids_per_owner = offsets.new_zeros(1)
    if batch_size:
        per_feature = offsets[batch_size::batch_size] - offsets[:-1:batch_size]
        ids_per_owner = torch.stack([per_feature[f].sum() for f in routed])
    most = ids_per_owner.max()
    per_sample = (most + batch_size - 1) // batch_size if batch_size else most * 0
    sizes = torch.stack([torch.tensor(batch_size, device=device), most, per_sample])
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    batch, ids, per_sample = sizes.tolist()
    return batch, ids, per_sample
