"""NVSHMEM transport: symmetric GPU memory from nvshmem4py, one-sided puts and signals
issued from Triton kernels (``torchrec_pgas.kernels``).

Every operation is stream ordered on the current CUDA stream: ``wait`` enqueues a
device-side wait, so the host never blocks on a peer and nothing syncs the device.
A wait that times out on the device leaves an error record that ``check`` turns into
a ``PgasTimeoutError`` on the host.
"""

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from torchrec_pgas.kernels.signals import WAIT_DATA, WAIT_OUT_FREE, WAIT_SLOT_FREE
from torchrec_pgas.transport.base import (
    PgasTimeoutError,
    PgasTransportUnavailableError,
    SignalArray,
    SymmetricBuffer,
    Transport,
    raise_unless_every_rank_ready,
)
from torchrec_pgas.types import RemotePath

logger = logging.getLogger(__name__)

_SETUP_HINT = (
    "install the GPU extra (pip install 'torchrec-pgas[gpu]': nvshmem4py-cu13, "
    "nvidia-nvshmem-cu13, triton) and run one process per GPU"
)
#: What a job whose ranks cannot all reach each other through NVSHMEM must set up.
_REMOTE_HINT = (
    "between nodes NVSHMEM needs a remote transport: set NVSHMEM_REMOTE_TRANSPORT=ibrc "
    "(InfiniBand or RoCE, through a proxy thread), =ucx, or =ibgda with "
    "NVSHMEM_IB_ENABLE_IBGDA=1 (GPU-initiated), and check that the NICs are visible to "
    "every process; within a node, leave NVSHMEM_DISABLE_P2P unset and check `nvidia-smi "
    "topo -m` and CUDA_VISIBLE_DEVICES; launch one process (one NVSHMEM PE) per GPU; "
    "NVSHMEM_DEBUG=INFO lists the transports NVSHMEM found"
)
#: The longest the set-up waits for a probe of a peer without a peer mapping.
_PROBE_TIMEOUT_S = 30.0
_WHAT = {
    WAIT_SLOT_FREE.value: "a slot to be released",
    WAIT_OUT_FREE.value: "an output slot to be released",
    WAIT_DATA.value: "data",
}


def _import_nvshmem():
    try:
        import nvshmem.core as nvshmem
        from nvshmem.core import NvshmemKernelObject
    except ImportError as e:
        raise PgasTransportUnavailableError(f"NVSHMEM is not available ({e}): {_SETUP_HINT}") from e
    return nvshmem, NvshmemKernelObject


def _cuda_core_device(index: int):
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    return Device(index)


_REGISTERED: Set[int] = set()

#: NVSHMEM starts once per process: the transports (one per process group and timeout,
#: every one over all processes) share it, and the last to close finalizes it.
_users = 0


def _register_module(module, function, name, metadata_group, hash) -> None:  # noqa: A002
    """Triton's kernel-load hook: NVSHMEM must initialize every module that may call it
    before its first launch."""
    from torchrec_pgas.kernels.nvshmem_device import needs_module_init

    if module in _REGISTERED or not needs_module_init(name, metadata_group):
        return
    nvshmem, kernel_object = _import_nvshmem()
    nvshmem.module_init(kernel_object.from_handle(module))
    _REGISTERED.add(module)


class NvshmemTransport(Transport):
    """NVSHMEM over the ranks of ``pg``, one GPU per rank.

    Args:
        pg: the process group (its ranks are the NVSHMEM PEs, in order).
        device: this rank's GPU.
        timeout_s: device-side waits give up after this long.
        remote_path: which peers the kernels write into with plain stores through a
            peer mapping and which through NVSHMEM puts (``PgasOptions.remote_path``).

    After set-up, ``direct[q]`` says whether this rank stores into peer ``q`` through
    its peer mapping (else the kernels' put path serves ``q``), and ``puts_anywhere``
    whether any rank serves some peer by puts: the same on every rank, it decides
    whether the exchanges allocate staging buffers (a collective).
    """

    def __init__(
        self, pg: dist.ProcessGroup, device: torch.device, timeout_s: float, remote_path: RemotePath = "auto"
    ) -> None:
        import triton

        self.group = pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        try:
            nvshmem, _ = _import_nvshmem()
            problem = None if device.type == "cuda" else f"the NVSHMEM transport needs a CUDA device, got {device}"
        except PgasTransportUnavailableError as e:
            problem = str(e)
        raise_unless_every_rank_ready(pg, problem)
        self._nvshmem = nvshmem
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.timeout_ns = int(timeout_s * 1e9)
        self._timeout_s = timeout_s
        torch.cuda.set_device(self.device)

        global _users
        if not _users:  # the same on every rank: transports are made collectively
            problem = self._start_nvshmem()
            try:
                raise_unless_every_rank_ready(pg, problem)
            except PgasTransportUnavailableError:
                if problem is None:  # started here, not everywhere
                    nvshmem.finalize()
                raise
        _users += 1
        triton.knobs.runtime.kernel_load_end_hook = _register_module
        self._live: List[torch.Tensor] = []
        self._owners: Dict[int, Any] = {}  # open owners of symmetric tensors, by id
        self._retired: Set[int] = set()
        self._next_owner = 0
        self._released = False
        try:
            self.err = self.symmetric_tensor((4,), torch.int64)
            # Targets for the interface's plain puts and signals, whose kernel always
            # sets a signal word and takes a destination buffer.
            self._scratch_signals = self.symmetric_tensor((self.world_size,), torch.int64)
            self._scratch_bytes = self.symmetric_tensor((8,), torch.uint8)
            self._choose_paths(remote_path)
        except Exception:
            self._release()
            raise
        self._closed = False

    def _start_nvshmem(self) -> Optional[str]:
        """Initializes NVSHMEM over this transport's group, with a unique id from its
        first rank; returns what went wrong, if anything."""
        import numpy as np

        nvshmem, pg = self._nvshmem, self.group
        uid = nvshmem.get_unique_id(empty=self.rank != 0)
        raw = [uid._data.view(np.int8).tobytes() if self.rank == 0 else None]
        dist.broadcast_object_list(raw, src=dist.get_global_rank(pg, 0), group=pg)
        uid._data.view(np.int8)[:] = np.frombuffer(raw[0], dtype=np.int8)
        try:
            nvshmem.init(
                device=_cuda_core_device(self.device.index),
                uid=uid,
                rank=self.rank,
                nranks=self.world_size,
                initializer_method="uid",
            )
        except Exception as e:
            return f"NVSHMEM initialization failed ({e}); {_SETUP_HINT}; if the job spans nodes, {_REMOTE_HINT}"
        return None

    def _release(self) -> None:
        """Closes every owner of symmetric tensors still open, frees this transport's
        symmetric tensors (collective), and finalizes NVSHMEM if it was the last
        transport."""
        global _users
        self._released = True
        try:
            for owner in list(self._owners.values()):
                owner.close()  # forgets its tensors: they are freed below, in order
            torch.cuda.synchronize(self.device)
            for t in self._live:
                self._nvshmem.free_tensor(t)
            self._live.clear()
        finally:
            _users -= 1
            if not _users:
                self._nvshmem.finalize()

    def symmetric_tensor(self, shape, dtype) -> torch.Tensor:
        """A zeroed symmetric tensor (collective: every rank allocates the same shapes
        in the same order). It lives until ``free_tensors``, or until the transport
        closes."""
        t = self._nvshmem.tensor(shape, dtype=dtype)
        t.zero_()
        self._live.append(t)
        return t

    def register(self, owner: Any) -> int:
        """Makes ``owner`` (a ``DeviceBuffers``, anything with ``close``) one whose
        ``close`` this transport calls from ``reclaim`` once every rank has retired it,
        or at its own close; returns its id. Call it where every rank allocates, in
        the same order on every rank."""
        self._next_owner += 1
        self._owners[self._next_owner] = owner
        return self._next_owner

    def unregister(self, owner_id: int) -> None:
        """Forgets an owner that closed."""
        self._owners.pop(owner_id, None)
        self._retired.discard(owner_id)

    def retire(self, owner_id: int) -> None:
        """Marks an owner as unused (when its model is garbage collected). Freeing is
        collective, so its ``close`` waits for ``reclaim``."""
        self._retired.add(owner_id)

    def reclaim(self) -> None:
        """Closes the owners every rank has retired (collective: call it where every
        rank allocates, such as a new model's first batch), owner by owner in order,
        so the ranks' heaps stay the same whatever order their garbage collectors ran
        in."""
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, sorted(self._retired), group=self.group)
        for owner_id in sorted(set.intersection(*(set(ids) for ids in everyone))):
            self._owners[owner_id].close()

    def free_tensors(self, tensors: List[torch.Tensor]) -> None:
        """Frees symmetric tensors (collective) once this rank's queued work is done
        and every rank got here; nothing once the transport is closing (it frees all
        that is left)."""
        if self._released:
            return
        torch.cuda.synchronize(self.device)
        self.barrier()
        for t in tensors:
            # By identity: list.remove would compare tensors element-wise.
            self._live = [x for x in self._live if x is not t]
            self._nvshmem.free_tensor(t)

    def _choose_paths(self, remote_path: RemotePath) -> None:
        """Sets ``direct`` and ``puts_anywhere`` (collective). Peers NVSHMEM gives no
        peer mapping to (``nvshmem_ptr`` is null: another node) are probed with a
        signal round trip first, so that a job whose NVSHMEM cannot reach them raises
        here, on every rank, with what to set, rather than time out at its first step."""
        world, me = self.world_size, self.rank
        probe = self.symmetric_tensor((world,), torch.int64)
        mapped = [pe == me or self._nvshmem.get_peer_tensor(probe, pe) is not None for pe in range(world)]
        unmapped = [pe for pe in range(world) if not mapped[pe]]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, unmapped, group=self.group)
        senders = [q for q, theirs in enumerate(everyone) if me in theirs]
        problem = self._probe(probe, unmapped, senders) if unmapped or senders else None
        raise_unless_every_rank_ready(self.group, problem)
        self.direct = [pe == me or (remote_path == "auto" and mapped[pe]) for pe in range(world)]
        self.puts_anywhere = any(everyone) or (remote_path == "put" and world > 1)
        torch.cuda.synchronize(self.device)
        self.barrier()

    def _probe(self, sig: torch.Tensor, to: Sequence[int], senders: Sequence[int]) -> Optional[str]:
        """Sets word ``me`` of ``sig`` at every peer of ``to`` through NVSHMEM and waits
        (a short while) for ``senders`` to set theirs here; returns what failed."""
        from torchrec_pgas.kernels.put_signal import put_signal
        from torchrec_pgas.kernels.signal_wait import signal_wait

        who = (
            f"no peer (NVLink/P2P) access to ranks {list(to)}"
            if to
            else f"ranks {list(senders)} have no peer (NVLink/P2P) access to this rank"
        )
        if os.environ.get("NVSHMEM_REMOTE_TRANSPORT", "").lower() == "none":
            return f"{who}, and NVSHMEM_REMOTE_TRANSPORT=none leaves NVSHMEM no way between them: {_REMOTE_HINT}"
        dev = sig.device
        try:
            if to:
                peers = torch.tensor(list(to), dtype=torch.int32, device=dev)
                no_chunks = torch.empty(len(to), 0, 3, dtype=torch.int64, device=dev)
                put_signal(peers, no_chunks, self._scratch_bytes, sig, self._scratch_signals, self.err,
                           me=self.rank, step=1, free_target=0, timeout_ns=self.timeout_ns)  # fmt: skip
            timeout_ns = int(min(self._timeout_s, _PROBE_TIMEOUT_S) * 1e9)
            waited = torch.tensor(list(senders), dtype=torch.int32, device=dev)
            signal_wait(sig, waited, 1, self.err, WAIT_DATA.value, timeout_ns)
            torch.cuda.synchronize(dev)
            arrived = sig.tolist()
            self.err.zero_()
        except Exception as e:  # a put NVSHMEM has no transport for may fail here
            return f"{who}, and an NVSHMEM signal round trip with them failed ({type(e).__name__}: {e}): {_REMOTE_HINT}"
        late = [q for q in senders if arrived[q] < 1]
        if late:
            return (
                f"{who}, and NVSHMEM signals from ranks {late} did not arrive within "
                f"{min(self._timeout_s, _PROBE_TIMEOUT_S):.0f} s: {_REMOTE_HINT}"
            )
        return None

    def peer_addresses(self, t: torch.Tensor) -> torch.Tensor:
        """Addresses of every rank's copy of symmetric ``t`` in this process (int64
        [world]), 0 for a peer this rank serves by puts (``direct``)."""
        return torch.tensor(
            [
                self._nvshmem.get_peer_tensor(t, pe).data_ptr() if self.direct[pe] else 0
                for pe in range(self.world_size)
            ],
            dtype=torch.int64,
            device=t.device,
        )

    # -------------------------------------------------------- Transport API

    def alloc(self, nbytes: int) -> SymmetricBuffer:
        t = self.symmetric_tensor((max(nbytes, 8),), torch.uint8)
        return SymmetricBuffer(local=t[:nbytes], handle=t)

    def alloc_signals(self, size: int) -> SignalArray:
        return SignalArray(size=size, handle=self.symmetric_tensor((size,), torch.int64))

    def free(self, obj: "SymmetricBuffer | SignalArray") -> None:
        self.free_tensors([obj.handle])

    def _put_chunks(self, buf, peer, offset, src, rows, row_bytes, row_pitch) -> None:
        from torchrec_pgas.kernels.put_signal import put_signal

        base = src.data_ptr()
        chunks = torch.tensor(
            [[[offset + r * row_pitch, base + r * row_bytes, row_bytes] for r in range(rows)]],
            dtype=torch.int64,
        ).to(self.device, non_blocking=True)
        peers = torch.tensor([peer], dtype=torch.int32).to(self.device, non_blocking=True)
        # The kernel's own signal goes to a scratch word: callers signal explicitly
        # (``signal``), as the interface asks.
        put_signal(
            peers,
            chunks,
            buf.handle,
            self._scratch_signals,
            self._scratch_signals,
            self.err,
            self.rank,
            0,
            0,
            self.timeout_ns,
        )

    def put(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None:
        src = src.detach().contiguous()
        self._put_chunks(buf, peer, offset, src, 1, src.numel() * src.element_size(), 0)

    def put_rows(self, buf: SymmetricBuffer, peer: int, offset: int, row_pitch: int, src: torch.Tensor) -> None:
        src = src.detach().contiguous()
        if src.numel():
            row_bytes = src[0].numel() * src.element_size()
            self._put_chunks(buf, peer, offset, src, src.size(0), row_bytes, row_pitch)

    def signal(self, sig: SignalArray, peer: int, index: int, value: int) -> None:
        from torchrec_pgas.kernels.put_signal import put_signal

        # A put_signal with no chunks: fence, then set word ``index`` at ``peer``.
        peers = torch.tensor([peer], dtype=torch.int32).to(self.device, non_blocking=True)
        put_signal(
            peers,
            torch.empty(1, 0, 3, dtype=torch.int64, device=self.device),
            self._scratch_bytes,
            sig.handle,
            self._scratch_signals,
            self.err,
            index,
            value,
            0,
            self.timeout_ns,
        )

    def wait(self, sig: SignalArray, index: int, value: int, what: str) -> None:
        from torchrec_pgas.kernels.signal_wait import signal_wait

        peers = torch.tensor([index], dtype=torch.int32).to(self.device, non_blocking=True)
        signal_wait(sig.handle, peers, value, self.err, WAIT_DATA.value, self.timeout_ns)

    def check(self, context: Optional[str] = None) -> None:
        """Raises ``PgasTimeoutError`` if a device-side wait timed out (syncs the stream)."""
        record = self.err.tolist()
        if record[0]:
            self.err.zero_()
            what = _WHAT.get(record[2], "a signal")
            raise PgasTimeoutError(
                f"rank {self.rank}: timed out after {self._timeout_s:.1f} s on the GPU waiting "
                f"for {what} from rank {record[1]} (a signal of at least {record[3]})"
                + (f" in {context}" if context else "")
            )

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._release()
        except Exception as e:  # at interpreter exit peers may be gone already
            logger.warning("NVSHMEM finalize failed: %s", e)
        self.group = None  # type: ignore[assignment]
