"""A step's route is passed in the open: the lookup input and output carry it beside
the data (``sharding/exchange.py``), nothing is hung on a tensor, and what TorchRec's
hooks see of the lookup is TorchRec's own types."""

import pytest
import torch
from dist_utils import assert_same_kt, make_tables, pgas_tw, random_kjt, run_ranks, shard, torchrec_tw, tw_placement
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor, PoolingType

from torchrec_pgas.sharder import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.sharding.dists import PgasPooledEmbeddingDist
from torchrec_pgas.sharding.exchange import HostBatch, PooledLookup
from torchrec_pgas.transport import PgasError


def test_output_dist_refuses_what_did_not_come_from_the_pgas_lookup():
    dist = PgasPooledEmbeddingDist(exchange=None, name="pgas_table_wise")  # type: ignore[arg-type]
    with pytest.raises(PgasError, match="not the PGAS lookup's output"):
        dist.pooled(torch.zeros(2, 3))  # type: ignore[arg-type]


def _steps_by_hand(rank, world_size):
    tables = make_tables(3, seed=11, pooling=PoolingType.MEAN)
    torch.manual_seed(11)
    ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = PgasEmbeddingBagCollectionSharder()
    pgas = shard(ref, tw_placement(tables, [1, 0, 1], pgas_tw), world_size, sharder)
    tw = shard(ref, tw_placement(tables, [1, 0, 1], torchrec_tw), world_size, sharder)
    sharded = pgas.module.ebc
    kjt = random_kjt(tables, 3 + 2 * rank, rank)
    assert_same_kt(pgas(kjt), tw(kjt), exact=True)  # the first batch sets the steps up
    # The tracker hook sees the lookup's KJT and pooled tensor, as under TorchRec's types.
    seen = []
    sharded.post_lookup_tracker_fn = lambda features, embs, module, _: seen.append((features, embs))
    for step in range(2):
        kjt = random_kjt(tables, 2 + rank + step, 10 * step + rank)
        assert_same_kt(pgas(kjt), tw(kjt), exact=True)
    sharded.post_lookup_tracker_fn = None
    assert len(seen) == 2
    for features, embs in seen:
        assert isinstance(features, KeyedJaggedTensor) and type(embs) is torch.Tensor
    # The steps by hand: the route rides beside the data, never on it.
    dist_input = sharded._input_dists[0].send_and_receive(random_kjt(tables, 4, 100 + rank))
    assert isinstance(dist_input, HostBatch) and not hasattr(dist_input.kjt, "_pgas_route")
    pooled = sharded._lookups[0](dist_input)
    assert isinstance(pooled, PooledLookup) and pooled.route is dist_input.route
    assert not hasattr(pooled.embs, "_pgas_route")
    assert sharded._output_dists[0].pooled(pooled).shape == (4, sum(t.embedding_dim for t in tables))


def test_route_is_passed_in_the_open_and_hooks_see_torchrec_types():
    run_ranks(_steps_by_hand, 2)
