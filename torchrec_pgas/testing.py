"""Helpers for comparing a sharded model with its unsharded original, the way one
judges a sharding type: same weights in, same outputs and updates out."""

from typing import Dict

import torch
import torch.distributed as dist
from torch import nn


def _shards(value):
    # ShardedTensor and TorchRec's own sharded tensors expose local_shards();
    # data-parallel tables are plain replicated tensors.
    return value.local_shards() if hasattr(value, "local_shards") else None


def load_unsharded_state_dict(sharded: nn.Module, full: Dict[str, torch.Tensor], prefix: str = "") -> None:
    """Copies the unsharded tensors ``full`` into the local shards of ``sharded``.

    ``sharded.state_dict()`` keys are ``prefix`` + the keys of ``full``; keys that do
    not start with ``prefix`` are left alone.
    """
    for key, value in sharded.state_dict().items():
        if not key.startswith(prefix) or key[len(prefix) :] not in full:
            continue
        src = full[key[len(prefix) :]]
        shards = _shards(value)
        if shards is None:
            value.detach().copy_(src)
            continue
        for s in shards:
            (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            s.tensor.detach().copy_(src[r : r + nr, c : c + nc])


def gather_unsharded_state_dict(
    sharded: nn.Module, like: Dict[str, torch.Tensor], prefix: str = ""
) -> Dict[str, torch.Tensor]:
    """The whole tensors of ``sharded`` named like ``like``'s keys, on every rank
    (collective: a sum all-reduce of zero-padded shards)."""
    out = {}
    for key, value in sharded.state_dict().items():
        name = key[len(prefix) :]
        if not key.startswith(prefix) or name not in like:
            continue
        shards = _shards(value)
        if shards is None:
            out[name] = value.detach().clone()
            continue
        full = torch.zeros_like(like[name])
        for s in shards:
            (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            full[r : r + nr, c : c + nc] = s.tensor.detach()
        dist.all_reduce(full)
        out[name] = full
    return out
