"""How ``NvshmemTransport`` starts: importing nvshmem4py, starting NVSHMEM over a
process group, loading Triton kernels into it, and choosing, peer by peer, between
stores through a peer mapping and NVSHMEM puts (after probing that NVSHMEM reaches
every peer without a mapping).

Each step that may fail on some ranks only returns (or raises) a message naming what
to set, which the transport makes every rank raise (``raise_unless_every_rank_ready``):
a rank that went on alone would wait for the others forever.
"""

import os
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from torchrec_pgas.kernels.signals import WAIT_DATA
from torchrec_pgas.transport.base import PgasTransportUnavailableError, raise_unless_every_rank_ready
from torchrec_pgas.types import RemotePath

if TYPE_CHECKING:
    from torchrec_pgas.transport.nvshmem import NvshmemTransport

SETUP_HINT = (
    "install the GPU extra (pip install 'torchrec-pgas[gpu]': nvshmem4py-cu13, "
    "nvidia-nvshmem-cu13, triton) and run one process per GPU"
)
#: What a job whose ranks cannot all reach each other through NVSHMEM must set up.
REMOTE_HINT = (
    "between nodes NVSHMEM needs a remote transport: set NVSHMEM_REMOTE_TRANSPORT=ibrc "
    "(InfiniBand or RoCE, through a proxy thread), =ucx, or =ibgda with "
    "NVSHMEM_IB_ENABLE_IBGDA=1 (GPU-initiated), and check that the NICs are visible to "
    "every process; within a node, leave NVSHMEM_DISABLE_P2P unset and check `nvidia-smi "
    "topo -m` and CUDA_VISIBLE_DEVICES; launch one process (one NVSHMEM PE) per GPU; "
    "NVSHMEM_DEBUG=INFO lists the transports NVSHMEM found"
)
#: The longest the set-up waits for a probe of a peer without a peer mapping.
PROBE_TIMEOUT_S = 30.0


def import_nvshmem():
    try:
        import nvshmem.core as nvshmem
        from nvshmem.core import NvshmemKernelObject
    except ImportError as e:
        raise PgasTransportUnavailableError(f"NVSHMEM is not available ({e}): {SETUP_HINT}") from e
    return nvshmem, NvshmemKernelObject


def cuda_core_device(index: int):
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    return Device(index)


_REGISTERED: Set[int] = set()


def register_module(module, function, name, metadata_group, hash) -> None:  # noqa: A002
    """Triton's kernel-load hook: NVSHMEM must initialize every module that may call it
    before its first launch."""
    from torchrec_pgas.kernels.nvshmem_device import needs_module_init

    if module in _REGISTERED or not needs_module_init(name, metadata_group):
        return
    nvshmem, kernel_object = import_nvshmem()
    nvshmem.module_init(kernel_object.from_handle(module))
    _REGISTERED.add(module)


def start_nvshmem(
    nvshmem: Any, pg: dist.ProcessGroup, rank: int, world_size: int, index: int, core_device: Callable[[int], Any]
) -> Optional[str]:
    """Initializes NVSHMEM over ``pg``, with a unique id from its first rank, on CUDA
    device ``index`` (``core_device`` makes its ``cuda.core`` device: the caller's, so
    that CPU tests can stand in for it); returns what went wrong, if anything."""
    import numpy as np

    uid = nvshmem.get_unique_id(empty=rank != 0)
    raw = [uid._data.view(np.int8).tobytes() if rank == 0 else None]
    dist.broadcast_object_list(raw, src=dist.get_global_rank(pg, 0), group=pg)
    uid._data.view(np.int8)[:] = np.frombuffer(raw[0], dtype=np.int8)
    try:
        nvshmem.init(
            device=core_device(index),
            uid=uid,
            rank=rank,
            nranks=world_size,
            initializer_method="uid",
        )
    except Exception as e:
        return f"NVSHMEM initialization failed ({e}); {SETUP_HINT}; if the job spans nodes, {REMOTE_HINT}"
    return None


def choose_paths(t: "NvshmemTransport", remote_path: RemotePath) -> Tuple[List[bool], bool]:
    """Returns the transport's ``direct`` and ``puts_anywhere`` (collective). Peers
    NVSHMEM gives no peer mapping to (``nvshmem_ptr`` is null: another node) are probed
    with a signal round trip first, so that a job whose NVSHMEM cannot reach them
    raises here, on every rank, with what to set, rather than time out at its first
    step."""
    world, me = t.world_size, t.rank
    probe = t.symmetric_tensor((world,), torch.int64)
    mapped = [pe == me or t._nvshmem.get_peer_tensor(probe, pe) is not None for pe in range(world)]
    unmapped = [pe for pe in range(world) if not mapped[pe]]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, unmapped, group=t.group)
    senders = [q for q, theirs in enumerate(everyone) if me in theirs]
    problem = _probe(t, probe, unmapped, senders) if unmapped or senders else None
    raise_unless_every_rank_ready(t.group, problem)
    direct = [pe == me or (remote_path == "auto" and mapped[pe]) for pe in range(world)]
    puts_anywhere = any(everyone) or (remote_path == "put" and world > 1)
    torch.cuda.synchronize(t.device)
    t.barrier()
    return direct, puts_anywhere


def _probe(t: "NvshmemTransport", sig: torch.Tensor, to: Sequence[int], senders: Sequence[int]) -> Optional[str]:
    """Sets word ``me`` of ``sig`` at every peer of ``to`` through NVSHMEM and waits
    (a short while) for ``senders`` to set theirs here; returns what failed."""
    from torchrec_pgas.kernels.put_signal import put_signal
    from torchrec_pgas.kernels.signal_wait import signal_wait
    from torchrec_pgas.kernels.step_clock import fixed

    who = (
        f"no peer (NVLink/P2P) access to ranks {list(to)}"
        if to
        else f"ranks {list(senders)} have no peer (NVLink/P2P) access to this rank"
    )
    if os.environ.get("NVSHMEM_REMOTE_TRANSPORT", "").lower() == "none":
        return f"{who}, and NVSHMEM_REMOTE_TRANSPORT=none leaves NVSHMEM no way between them: {REMOTE_HINT}"
    dev = sig.device
    try:
        if to:
            peers = torch.tensor(list(to), dtype=torch.int32, device=dev)
            no_chunks = torch.empty(len(to), 0, 3, dtype=torch.int64, device=dev)
            put_signal(peers, no_chunks, t._scratch_bytes, sig, t._scratch_signals, t.err,
                       me=t.rank, step=fixed(1, dev), wait_depth=0, timeout_ns=t.timeout_ns)  # fmt: skip
        timeout_ns = int(min(t._timeout_s, PROBE_TIMEOUT_S) * 1e9)
        waited = torch.tensor(list(senders), dtype=torch.int32, device=dev)
        signal_wait(sig, waited, fixed(1, dev), t.err, WAIT_DATA.value, timeout_ns)
        torch.cuda.synchronize(dev)
        arrived = sig.tolist()
        t.err.zero_()
    except Exception as e:  # a put NVSHMEM has no transport for may fail here
        return f"{who}, and an NVSHMEM signal round trip with them failed ({type(e).__name__}: {e}): {REMOTE_HINT}"
    late = [q for q in senders if arrived[q] < 1]
    if late:
        return (
            f"{who}, and NVSHMEM signals from ranks {late} did not arrive within "
            f"{min(t._timeout_s, PROBE_TIMEOUT_S):.0f} s: {REMOTE_HINT}"
        )
    return None
