"""Mean pooling of row-wise partial sums, the strategy both row-wise exchanges (host
and GPU) are given."""

import collections
from typing import Deque, List, Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.tw_base import shape_problem


class MeanAfterSum:
    """Owners pool sums; the requester divides its summed rows by a divisor built as
    TorchRec's ``_create_mean_pooling_divisor`` builds it, so results agree to the bit:
    per bag, the number of ids (the sum of their weights, for weighted features) under
    mean-pooled features and 1 under sum-pooled ones, plus 1e-6.

    The divisor of a batch is built from the batch a rank sends (``sent``) and taken
    by the receive of that step (``take``): each rank divides its own samples' rows.

    Args:
        dims: each feature's embedding dim, in the sharding's order.
        mean: whether each feature's table pools by mean.
        device: where the divisors are built.
        by_count: weighted bags divide by their number of ids too, as FBGEMM's int-N
            kernels (quantized tables) do, rather than by their weights' sum.
    """

    def __init__(self, dims: Sequence[int], mean: Sequence[bool], device: torch.device, by_count: bool = False) -> None:
        self._any_mean = any(mean)
        self._by_count = by_count
        self._dev = device
        # [F, 1]: which of the sharding's features keep their bags' lengths.
        self._mean = torch.tensor(list(mean), dtype=torch.bool, device=device).view(-1, 1)
        self._feature_dims = torch.tensor(dims, dtype=torch.int64, device=device)
        self._width = sum(dims)
        self._identity = list(range(len(dims)))
        # The positions of the last batch and their index tensor (built once: a copy
        # to the device every step would cost a host step).
        self._positions: List[int] = self._identity
        self._index: Optional[torch.Tensor] = None
        self._divisors: Deque[Optional[torch.Tensor]] = collections.deque()

    @property
    def divides(self) -> bool:
        """Whether some feature pools by mean (its batches get divisors)."""
        return self._any_mean

    def divisor(self, kjt: KeyedJaggedTensor, positions: Optional[Sequence[int]] = None) -> Optional[torch.Tensor]:
        """``[batch, sum of dims]`` for a batch in which the sharding's feature ``i`` is
        at ``positions[i]`` (None: the sharding's features in order; other features of
        the batch are left out), or None without mean-pooled features (or for a batch
        the send reports a problem of). Reads nothing back to the host: every feature's
        bags are summed, then the sharding's are picked by position. A batch with bad
        lengths gets some divisor, in bounds, and its step raises."""
        if not self._any_mean or kjt.variable_stride_per_key() or shape_problem(kjt) is not None:
            return None
        batch = kjt.stride()
        if batch == 0:
            return None
        weights = kjt.weights_or_none()
        if weights is not None and weights.is_floating_point() and not self._by_count:
            # Offsets past the weights (lengths that disagree with them) read none.
            offsets = kjt.offsets().clamp(0, weights.numel()).int()
            lengths = torch.ops.fbgemm.segment_sum_csr(1, offsets, weights.to(torch.float32))
        else:
            lengths = kjt.lengths()
        per_feature = lengths.reshape(-1, batch)
        index = self._index_of(positions, per_feature.size(0))
        if index is not None:
            per_feature = per_feature.index_select(0, index)
        # Sum-pooled features divide by 1 (then 1 + 1e-6, as TorchRec's).
        per_feature = torch.where(self._mean, per_feature, 1).T
        divisor = torch.repeat_interleave(per_feature, repeats=self._feature_dims, dim=1, output_size=self._width)
        return divisor + 1e-6

    def _index_of(self, positions: Optional[Sequence[int]], num_features: int) -> Optional[torch.Tensor]:
        """The index of the sharding's features among the batch's ``num_features``, or
        None if they are all of them, in order."""
        pos = self._identity if positions is None else list(positions)
        if pos == self._identity and num_features == len(pos):
            return None
        if pos != self._positions or self._index is None:
            self._positions = pos
            self._index = torch.tensor(pos, dtype=torch.int64, device=self._dev)
        return self._index

    def sent(self, divisor: Optional[torch.Tensor]) -> None:
        """Keeps the divisor of the step just sent."""
        self._divisors.append(divisor)

    def take(self) -> Optional[torch.Tensor]:
        """The divisor of the oldest step sent and not yet received (or dropped)."""
        return self._divisors.popleft()
