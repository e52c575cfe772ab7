"""What differs between the host exchanges of the sharding types, given to
``TwExchange``'s constructor: how ids are routed to their owners
(``TableWiseHostIds``, ``RowBlockHostIds``), and where owners put pooled rows and
how a requester combines them into its output (``ColumnBlockOutput``,
``PartialSumOutput``). ``device_routing`` holds the GPU counterparts."""

from typing import List, Optional, Protocol, Sequence

import torch
from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.tw_base import InputRouting, dense_batch
from torchrec_pgas.transport import Mailbox, SymmetricBuffer, Transport

# ---------------------------------------------------------------- ids routing


class HostIdsRouting(InputRouting, Protocol):
    """Which owner gets which of a batch's ids (``TableWiseHostIds``,
    ``RowBlockHostIds``), and which batches it can route (``InputRouting``)."""

    def by_owner(self, kjt: KeyedJaggedTensor, input_pos: Optional[Sequence[int]]) -> KeyedJaggedTensor:
        """``kjt``'s features of the sharding, each owner's contiguous, owner by owner,
        in the order its lookup takes them (``input_pos``: where each of the
        sharding's input features is in ``kjt``, which may hold other shardings'
        features too, see ``adopt_input_order``; None: ``kjt`` is the sharding's
        features in order)."""


class TableWiseHostIds:
    """Table-wise routing: TorchRec orders the sharding's features by owner, so a
    batch in that order is routed as it is, and any other batch is permuted into it
    (which also leaves out other shardings' features)."""

    def by_owner(self, kjt: KeyedJaggedTensor, input_pos: Optional[Sequence[int]]) -> KeyedJaggedTensor:
        return kjt if input_pos is None else dense_batch(kjt).permute(list(input_pos))

    def routable(self, input_pos: Sequence[int], num_keys: Optional[int] = None) -> bool:
        """Any batch: a permute routes it."""
        return True


class RowBlockHostIds:
    """Row-wise routing: ids bucketed by row block (FBGEMM's
    ``block_bucketize_sparse_features``, as TorchRec does); owner ``r`` gets keys
    ``r * F ... (r + 1) * F - 1``, ids local to its block. ``block_sizes``: int64
    [F], rows per block of each feature's table."""

    def __init__(self, block_sizes: torch.Tensor, world_size: int) -> None:
        self._block_sizes = block_sizes
        self._world = world_size

    def by_owner(self, kjt: KeyedJaggedTensor, input_pos: Optional[Sequence[int]]) -> KeyedJaggedTensor:
        """Any other batch than the sharding's own features in order is permuted into
        that first: the row blocks are per feature in that order."""
        kjt = dense_batch(kjt)
        if input_pos is not None:
            kjt = kjt.permute(list(input_pos))
        bucketized, _ = bucketize_kjt_before_all2all(kjt, num_buckets=self._world, block_sizes=self._block_sizes)
        return bucketized

    def routable(self, input_pos: Sequence[int], num_keys: Optional[int] = None) -> bool:
        """Any batch: a permute puts it in the sharding's order."""
        return True


# ------------------------------------------------------------------- output


class HostOutput(Protocol):
    """Where owners put pooled rows in a requester's output slots and how the
    requester forms its output from them (``ColumnBlockOutput``,
    ``PartialSumOutput``)."""

    #: Whether every owner has a slot of its own at a requester (``Mailbox``).
    per_source: bool
    #: Per owner, the first column of its block of a requester's output (and so of the
    #: output gradient the owner gets back).
    col_offsets: Sequence[int]
    #: Columns of a requester's output.
    width: int

    def put(self, transport: Transport, buffer: SymmetricBuffer, requester: int, base: int, rows: torch.Tensor) -> None:
        """Puts this owner's pooled ``rows`` for ``requester`` into its slot at ``base``."""

    def take(
        self, box: Mailbox, step: int, batch: int, dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Waits for the owners' rows of ``step``, releases their slots and returns this
        rank's output, ``[batch, width]``: ``out`` if given (a slice of the module's
        joined output), else a tensor of its own (slots are reused)."""


class ColumnBlockOutput:
    """Table-wise: a requester has one output slot, ``[rows, sum(dims)]``; owner ``o``
    puts its pooled rows at its columns, so the slot is the output as it is, and no
    permute is needed. ``dims``: per rank, the total dim of its tables; ``me``: this
    rank."""

    per_source = False

    def __init__(self, dims: Sequence[int], me: int) -> None:
        self._dims = list(dims)
        self._me = me
        self.width = sum(self._dims)
        self._owners = [r for r, d in enumerate(self._dims) if d > 0]
        self.col_offsets: List[int] = [sum(self._dims[:r]) for r in range(len(self._dims))]

    def put(self, transport: Transport, buffer: SymmetricBuffer, requester: int, base: int, rows: torch.Tensor) -> None:
        elem = rows.element_size()
        transport.put_rows(buffer, requester, base + self.col_offsets[self._me] * elem, self.width * elem, rows)

    def take(
        self, box: Mailbox, step: int, batch: int, dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        for owner in self._owners:
            box.wait(owner, step)
        nbytes = batch * self.width * torch.empty((), dtype=dtype).element_size()
        slot = box.slot(self._me, step)[:nbytes].view(dtype).view(batch, self.width)
        out = slot.clone() if out is None else out.copy_(slot)
        for owner in self._owners:
            box.release(owner, step)
        return out


class PartialSumOutput:
    """Row-wise: every owner puts whole partial rows, ``[rows, width]``, into its own
    slot at the requester, which adds them in rank order, so the sum does not depend
    on the order they arrive in."""

    per_source = True

    def __init__(self, world_size: int, width: int) -> None:
        self._world = world_size
        self.width = width
        self.col_offsets: List[int] = [0] * world_size  # every owner covers every column

    def put(self, transport: Transport, buffer: SymmetricBuffer, requester: int, base: int, rows: torch.Tensor) -> None:
        transport.put(buffer, requester, base, rows)

    def take(
        self, box: Mailbox, step: int, batch: int, dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        nbytes = batch * self.width * torch.empty((), dtype=dtype).element_size()
        out = torch.zeros(batch, self.width, dtype=dtype) if out is None else out.zero_()
        for owner in range(self._world):
            box.wait(owner, step)
            out += box.slot(owner, step)[:nbytes].view(dtype).view(batch, self.width)
            box.release(owner, step)
        return out
