"""The GPU path's failed sends: a rank whose send could not be prepared sends its error
message, and every rank raises it. Skipped without two GPUs and nvshmem4py. On the
GPU machine:
    python3 -m pytest -q tests/test_gpu_failure.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)
pytest.importorskip("nvshmem.core")

from dist_utils import make_tables, pgas_tw, random_kjt, run_ranks, shard, torchrec_tw, tw_placement  # noqa: E402
from torchrec import EmbeddingBagCollection  # noqa: E402

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder  # noqa: E402
from torchrec_pgas.sharding.tw_base import PgasInputError  # noqa: E402
from torchrec_pgas.types import PgasOptions  # noqa: E402


def _failed_send(rank, world_size):
    from torchrec_pgas.sharding import tw_device_exchange

    dev = torch.device("cuda", rank)
    tables = make_tables(3, seed=3)
    torch.manual_seed(3)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder(options=PgasOptions(timeout_s=60))
    pgas = shard(ref, tw_placement(tables, [0, 1, 0], pgas_tw), world_size, sharder, device=dev)
    tw = shard(ref, tw_placement(tables, [0, 1, 0], torchrec_tw), world_size, sharder, device=dev)
    good = random_kjt(tables, 8, seed=rank).to(dev)
    assert torch.equal(pgas(good).values(), tw(good).values())
    real = tw_device_exchange.send_input
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 1:
            raise RuntimeError("the batch could not be prepared on purpose")
        return real(*args, **kwargs)

    tw_device_exchange.send_input = fails_once
    try:
        # Every rank reads rank 1's message from its slot (not "(see that rank)").
        with pytest.raises(
            PgasInputError, match=r"rank 1 could not send its batch: RuntimeError: the batch could not be prepared"
        ):
            with torch.no_grad():
                pgas(good)
    finally:
        tw_device_exchange.send_input = real
    for grad_mode in (torch.no_grad(), torch.enable_grad()):  # the next batches are served
        with grad_mode:
            assert torch.equal(pgas(good).values(), tw(good).values())


def test_gpu_failed_send_message_reaches_every_rank():
    run_ranks(_failed_send, 2, backend="nccl")
