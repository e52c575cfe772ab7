"""Real multi-process runs for the tests: gloo process groups on this machine."""

import collections
import copy
import functools
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan

from torchrec_pgas.sharding_plan import pgas_table_wise
from torchrec_pgas.testing import load_unsharded_state_dict
from torchrec_pgas.transport import Mailbox
from torchrec_pgas.transport.host import HostTransport
from torchrec_pgas.types import PgasOptions


def _entry(rank: int, fn: Callable, world_size: int, store: str, backend: str, kwargs: Dict[str, Any]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank=rank, world_size=world_size, **kwargs)
    except BaseException:
        # Leave at once with the traceback on file: a normal exit runs NVSHMEM's and
        # gloo's teardown, which can wait forever for the ranks still in the test, so
        # the failure would be reported as a hang (and without its cause). Written
        # whole, then renamed: ``run_ranks`` reads it as soon as it is there.
        try:
            with open(f"{store}.rank{rank}.tmp", "w") as f:
                f.write(traceback.format_exc())
            os.replace(f"{store}.rank{rank}.tmp", f"{store}.rank{rank}.err")
        finally:
            os._exit(1)
    dist.barrier()
    # Every rank got here: leave without tearing gloo down. Teardown during interpreter
    # finalization has aborted processes ("terminate called without an active
    # exception"; see torchrec_pgas.transport._close_all), and a test's verdict must
    # not depend on it.
    os._exit(0)


def _rank_errors(store: str, world_size: int) -> str:
    """The tracebacks that ranks of the run at ``store`` left, rank by rank."""
    found = []
    for rank in range(world_size):
        path = f"{store}.rank{rank}.err"
        if os.path.exists(path):
            with open(path) as f:
                found.append(f"--- rank {rank} ---\n{f.read()}")
    return "\n".join(found)


#: The DLRM example's scripts.
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "dlrm")


def torchrun(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``torch.distributed.run`` on two local processes with ``args`` (a script
    or ``-m module``, then its arguments); returns the finished run, output captured,
    so a test can check a failure as well as a success."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def torchrun_ok(*args: str) -> str:
    """``torchrun(*args)`` that must succeed; returns its stdout. A failure shows the
    ends of both streams, where the failing rank's traceback is."""
    done = torchrun(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def run_example(script: str, *args: str) -> str:
    """Runs an example script on two processes with torchrun; returns its stdout."""
    return torchrun_ok(os.path.join(EXAMPLE, script), *args)


def run_ranks(fn: Callable, world_size: int, backend: str = "gloo", deadline_s: float = 600, **kwargs: Any) -> None:
    """Runs ``fn(rank=, world_size=, **kwargs)`` in ``world_size`` fresh processes of
    one process group (``nccl``: rank r on GPU r); a failure in any rank fails the
    caller with that rank's traceback, and ranks still running after ``deadline_s``
    are killed and fail it too (a hang is a failure, not a stuck CI)."""
    # A file store, not a TCP port: a free port found here may be taken (by NCCL or
    # NVSHMEM of the test before) by the time rank 0 listens on it.
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, store, backend, kwargs),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        end = time.monotonic() + deadline_s
        while True:
            try:
                if ctx.join(timeout=1.0):
                    return
            except mp.ProcessExitedException as e:
                errors = _rank_errors(store, world_size)
                if not errors:
                    raise
                # join() has terminated the other ranks already.
                raise AssertionError(f"{fn.__name__} failed:\n{errors}") from e
            errors = _rank_errors(store, world_size)
            if errors or time.monotonic() >= end:
                for p in ctx.processes:
                    p.kill()
                for p in ctx.processes:
                    p.join(10)  # reaped: a GPU rank's teardown must not overlap the next test
                if errors:
                    # The ranks that did not fail wait for the one that did.
                    raise AssertionError(f"{fn.__name__} failed:\n{errors}")
                raise TimeoutError(f"{fn.__name__}: ranks still running after {deadline_s} s (a hang)")


def mailbox_payload(step: int, source: int, dest: int, n: int) -> torch.Tensor:
    """What ``source`` sends ``dest`` at ``step``: ``n`` random int64, one seed per message."""
    g = torch.Generator().manual_seed(step * 10_000 + source * 100 + dest)
    return torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64)


def stream_through_mailbox(t: HostTransport, box: Mailbox, rank: int, world_size: int, steps: int, n: int) -> None:
    """Sends ``steps`` steps of ``n`` int64 through ``box`` to every rank and checks
    every message received, with no barrier between steps: only the mailbox's signals
    order the reads, so a torn or early read shows."""
    for step in range(1, steps + 1):
        for dest in range(world_size):
            base = box.begin_send(dest, step)
            t.put(box.buffer, dest, base, mailbox_payload(step, rank, dest, n))
            box.end_send(dest, step)
        for source in range(world_size):
            box.wait(source, step)
            got = box.slot(source, step).view(torch.int64)
            assert torch.equal(got, mailbox_payload(step, source, rank, n)), (step, source)
            box.release(source, step)


class Wrapper(nn.Module):
    """DMP shards submodules, so the EBC under test sits one level down."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt)


def make_tables(
    num_tables: int,
    seed: int,
    pooling: PoolingType = PoolingType.SUM,
) -> List[EmbeddingBagConfig]:
    """Tables of uneven sizes and dims (dims a multiple of 4, as FBGEMM wants)."""
    g = torch.Generator().manual_seed(seed)
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=4 * int(torch.randint(1, 5, (1,), generator=g)),
            num_embeddings=int(torch.randint(5, 40, (1,), generator=g)),
            feature_names=[f"f{i}"],
            pooling=pooling,
        )
        for i in range(num_tables)
    ]


def random_kjt(
    tables: Sequence[EmbeddingBagConfig],
    batch_size: int,
    seed: int,
    weighted: bool = False,
    max_len: int = 4,
) -> KeyedJaggedTensor:
    """A KJT with empty bags, ids over the whole range of each table (bounds included)."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            ln = torch.randint(0, max_len + 1, (batch_size,), generator=g)
            keys.append(f)
            lengths.append(ln)
            values.append(torch.randint(0, t.num_embeddings, (int(ln.sum()),), generator=g))
    v = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
    return KeyedJaggedTensor(
        keys=keys,
        values=v,
        lengths=torch.cat(lengths) if lengths else torch.empty(0, dtype=torch.int64),
        weights=torch.rand(v.numel(), generator=g) if weighted else None,
    )


def in_order(kjt: KeyedJaggedTensor, keys: List[str]) -> KeyedJaggedTensor:
    """``kjt`` with its features in the order ``keys``."""
    return kjt.permute([kjt.keys().index(k) for k in keys])


def shared_gpu_options(world_size: int) -> PgasOptions:
    """Options of the GPU tests whose ranks share one GPU: peer mappings at world size 1,
    NVSHMEM puts between ranks (peer mappings between processes sharing a GPU are not
    reliable beyond two, see test_gpu_shared.py)."""
    return PgasOptions(timeout_s=60) if world_size == 1 else PgasOptions(timeout_s=60, remote_path="put")


def shard(
    ref: EmbeddingBagCollection,
    placement: Dict[str, Callable],
    world_size: int,
    sharder: Any,
    device: torch.device = torch.device("cpu"),
    pg: Optional[dist.ProcessGroup] = None,
    wrapper: Callable[[EmbeddingBagCollection], nn.Module] = None,
    local_size: Optional[int] = None,
) -> DistributedModelParallel:
    """A DMP of ``wrapper`` (default ``Wrapper``) around a copy of ``ref`` placed by
    ``placement`` (table -> generator), with ``ref``'s weights, on ``device`` over
    ``pg`` (default: the world group). Rank ``r``'s shards are placed on device
    ``r % local_size`` (default: one device per rank; 1 when ranks share a GPU)."""
    plan = construct_module_sharding_plan(
        ref,
        per_param_sharding=placement,
        world_size=world_size,
        local_size=local_size or world_size,
        device_type=device.type,
        sharder=sharder,
    )
    model = (wrapper or Wrapper)(copy.deepcopy(ref))
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(pg or dist.GroupMember.WORLD),
        device=device,
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    load_unsharded_state_dict(dmp, ref.state_dict(), prefix="ebc.")
    return dmp


#: Table-wise placements on the FUSED kernel, ours and TorchRec's: ``gen(rank)``.
pgas_tw = functools.partial(pgas_table_wise, compute_kernel="fused")
torchrec_tw = functools.partial(table_wise, compute_kernel="fused")


def tw_placement(tables: Sequence[EmbeddingBagConfig], owners: Sequence[int], gen: Callable) -> Dict[str, Callable]:
    return {t.name: gen(o) for t, o in zip(tables, owners)}


def assert_same_kt(actual, expected, exact: bool) -> None:
    a, e = actual.to_dict(), expected.to_dict()
    assert sorted(a) == sorted(e)
    for k in e:
        if exact:
            assert torch.equal(a[k], e[k]), (k, a[k], e[k])
        else:
            torch.testing.assert_close(a[k], e[k], rtol=1e-5, atol=1e-6)


def reference_pooled(
    tables: Sequence[EmbeddingBagConfig],
    weights: Dict[str, torch.Tensor],
    kjt: KeyedJaggedTensor,
    row_wise: Sequence[str] = (),
) -> Dict[str, torch.Tensor]:
    """Pooled embeddings per feature in float64, bag by bag: the independent oracle
    (the unsharded module has no weighted mean pooling). Mean pooling divides by the
    number of ids, as FBGEMM does; for the tables named in ``row_wise`` it is
    TorchRec's ``row_wise`` mean: by the number of ids or, weighted, the sum of their
    weights, plus 1e-6, and then sum-pooled tables are divided by 1 + 1e-6."""
    if kjt.stride() == 0:  # KeyedJaggedTensor.to_dict cannot split an empty batch
        assert len({f for t in tables for f in t.feature_names}) == sum(len(t.feature_names) for t in tables)
        return {f: torch.zeros(0, t.embedding_dim, dtype=torch.float64) for t in tables for f in t.feature_names}
    out = {}
    jt = kjt.to_dict()
    uses = collections.Counter(f for t in tables for f in t.feature_names)
    rw_mean = any(t.name in row_wise and t.pooling == PoolingType.MEAN for t in tables)
    for t in tables:
        table = weights[f"embedding_bags.{t.name}.weight"].double()
        for f in t.feature_names:
            rows = []
            for i, ids in enumerate(jt[f].to_dense()):
                w = (
                    jt[f].to_dense_weights()[i].double()
                    if kjt.weights_or_none() is not None
                    else torch.ones(len(ids), dtype=torch.float64)
                )
                pooled = (table[ids] * w[:, None]).sum(0)
                mean = t.pooling == PoolingType.MEAN
                if t.name in row_wise and rw_mean:
                    pooled = pooled / ((w.sum() if mean else 1.0) + 1e-6)
                elif mean and len(ids):
                    pooled = pooled / len(ids)
                rows.append(pooled)
            # TorchRec names a feature that several tables pool "feature@table".
            name = f if uses[f] == 1 else f"{f}@{t.name}"
            out[name] = torch.stack(rows) if rows else table.new_zeros(0, t.embedding_dim)
    return out


class Float64Training:
    """The float64 oracle of a training run: the unsharded tables in float64, trained
    on every rank's batch at once with FBGEMM's update rule (``EXACT_SGD``, or
    ``EXACT_ROWWISE_ADAGRAD``: a row's mean squared gradient added to its momentum,
    then the gradient over the square root plus ``eps``), for the loss
    ``sum(pooled * upstream)`` over every rank's pooled outputs, divided by the
    number of ranks where TorchRec divides (``comm_ops.get_gradient_division()``, on
    by default, so that sparse gradients are averaged as DDP averages dense ones).
    Pooling as :func:`reference_pooled`, gradients by autograd through it."""

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        state_dict: Dict[str, torch.Tensor],
        optimizer: Any,
        learning_rate: float,
        eps: float,
        row_wise: Sequence[str] = (),
    ) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        assert optimizer in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD), optimizer
        self.tables, self.row_wise = tables, row_wise
        self.adagrad = optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
        self.lr, self.eps = learning_rate, eps
        self.weights = {k: v.detach().double().clone() for k, v in state_dict.items()}
        self.momentum = {k: torch.zeros(v.shape[0], dtype=torch.float64) for k, v in self.weights.items()}

    def step(
        self,
        batches: Sequence[KeyedJaggedTensor],
        upstream: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]],
    ) -> List[Dict[str, torch.Tensor]]:
        """Each rank's batch's pooled outputs before the update (``batches[r]`` is rank
        r's), then one update by the gradient of the loss over all of them;
        ``upstream(pooled)`` gives the loss's gradient for a batch's pooled outputs."""
        leaves = {k: v.clone().requires_grad_() for k, v in self.weights.items()}
        outs = [reference_pooled(self.tables, leaves, kjt, self.row_wise) for kjt in batches]
        terms = [(o[k] * u.double()).sum() for o in outs for k, u in upstream(o).items() if o[k].requires_grad]
        if terms:
            loss = sum(terms) / (len(batches) if get_gradient_division() else 1)
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
            for (name, w), g in zip(self.weights.items(), grads):
                if g is None:
                    continue
                if self.adagrad:
                    self.momentum[name] += (g * g).mean(1)
                    g = g / (self.momentum[name].sqrt() + self.eps)[:, None]
                w -= self.lr * g
        return [{k: v.detach() for k, v in o.items()} for o in outs]


def upstream_grads(pooled: Dict[str, torch.Tensor], step: int) -> Dict[str, torch.Tensor]:
    """The loss's gradient for each feature's pooled rows at ``step`` (the training
    tests' loss is ``sum(pooled * upstream)``): the same on every rank, for every model
    and for ``Float64Training``."""
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(pooled[k].shape, generator=g) for k in sorted(pooled)}


def assert_as_close_as(
    actual: Dict[str, torch.Tensor], control: Dict[str, torch.Tensor], exact: Dict[str, torch.Tensor], floor: float
) -> None:
    """``actual`` is no further from the float64 ``exact`` than four times ``control``
    (the same computation in float32 by other kernels), or than ``floor``: float32
    sums in another order part by amounts that grow with the number of terms and their
    cancellation, which no fixed tolerance between the two bounds. The control itself
    is within 100 times ``floor`` (relative to the largest value), so that a mistake
    both share cannot pass."""
    assert sorted(actual) == sorted(exact) == sorted(control)
    for k, e in exact.items():
        scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
        off = float((actual[k].cpu().double() - e).abs().max()) if e.numel() else 0.0
        off_control = float((control[k].cpu().double() - e).abs().max()) if e.numel() else 0.0
        assert off_control <= 100 * floor * scale, f"{k}: the control is {off_control:.3g} from float64"
        assert off <= max(4 * off_control, floor * scale), f"{k}: {off:.3g} from float64, the control {off_control:.3g}"


def assert_close_to_reference(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for k, v in expected.items():
        torch.testing.assert_close(actual[k].cpu().double(), v, rtol=1e-5, atol=1e-6)
