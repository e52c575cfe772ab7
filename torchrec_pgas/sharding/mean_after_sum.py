"""Mean pooling of row-wise partial sums, the strategy both row-wise exchanges (host
and GPU) are given."""

import collections
from typing import Deque, Optional, Sequence

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
    """

    def __init__(self, dims: Sequence[int], mean: Sequence[bool], device: torch.device) -> None:
        self._any_mean = any(mean)
        self._sum_features = [i for i, m in enumerate(mean) if not m]
        self._feature_dims = torch.tensor(dims, dtype=torch.int64, device=device)
        self._width = sum(dims)
        self._divisors: Deque[Optional[torch.Tensor]] = collections.deque()

    def divisor(self, kjt: KeyedJaggedTensor) -> Optional[torch.Tensor]:
        """``[batch, sum of dims]`` for a batch in the sharding's feature order, or None
        without mean-pooled features (or for a batch the send reports a problem of)."""
        if not self._any_mean or kjt.variable_stride_per_key() or shape_problem(kjt) is not None:
            return None
        batch = kjt.stride()
        if batch == 0:
            return None
        weights = kjt.weights_or_none()
        if weights is not None and weights.is_floating_point():
            lengths = torch.ops.fbgemm.segment_sum_csr(1, kjt.offsets().int(), weights.to(torch.float32))
        else:
            lengths = kjt.lengths().clone()
        for feature in self._sum_features:
            lengths[feature * batch : (feature + 1) * batch] = 1
        per_feature = lengths.reshape(-1, batch).T
        divisor = torch.repeat_interleave(per_feature, repeats=self._feature_dims, dim=1, output_size=self._width)
        return divisor + 1e-6

    def sent(self, divisor: Optional[torch.Tensor]) -> None:
        """Keeps the divisor of the step just sent."""
        self._divisors.append(divisor)

    def take(self) -> Optional[torch.Tensor]:
        """The divisor of the oldest step sent and not yet received (or dropped)."""
        return self._divisors.popleft()
