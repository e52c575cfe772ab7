"""NVSHMEM transport: symmetric GPU memory from nvshmem4py, one-sided puts and signals
issued from Triton kernels (``torchrec_pgas.kernels``).

Every operation is stream ordered on the current CUDA stream: ``wait`` enqueues a
device-side wait, so the host never blocks on a peer and nothing syncs the device.
A wait that times out on the device leaves an error record that ``check`` turns into
a ``PgasTimeoutError`` on the host.
"""

import logging
from typing import Any, Dict, List, Optional, Set

import torch
import torch.distributed as dist

from torchrec_pgas.kernels.signals import WAIT_DATA, WAIT_OUT_FREE, WAIT_SLOT_FREE
from torchrec_pgas.kernels.step_clock import fixed
from torchrec_pgas.transport.base import (
    PgasTimeoutError,
    PgasTransportUnavailableError,
    SignalArray,
    SymmetricBuffer,
    Transport,
    raise_unless_every_rank_ready,
)
from torchrec_pgas.transport.nvshmem_setup import choose_paths, register_module, start_nvshmem
from torchrec_pgas.transport.nvshmem_setup import cuda_core_device as _cuda_core_device
from torchrec_pgas.transport.nvshmem_setup import import_nvshmem as _import_nvshmem
from torchrec_pgas.types import RemotePath

logger = logging.getLogger(__name__)

_WHAT = {
    WAIT_SLOT_FREE.value: "a slot to be released",
    WAIT_OUT_FREE.value: "an output slot to be released",
    WAIT_DATA.value: "data",
}

#: NVSHMEM starts once per process: the transports (one per process group and timeout,
#: every one over all processes) share it, and the last to close finalizes it.
_users = 0


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
            # ``_cuda_core_device`` is looked up here, at the call: CPU tests replace it.
            problem = start_nvshmem(nvshmem, pg, self.rank, self.world_size, self.device.index, _cuda_core_device)
            try:
                raise_unless_every_rank_ready(pg, problem)
            except PgasTransportUnavailableError:
                if problem is None:  # started here, not everywhere
                    nvshmem.finalize()
                raise
        _users += 1
        triton.knobs.runtime.kernel_load_end_hook = register_module
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
            self.direct, self.puts_anywhere = choose_paths(self, remote_path)
        except Exception:
            self._release()
            raise
        self._closed = False

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
            fixed(0, self.device),
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
            fixed(value, self.device),
            0,
            self.timeout_ns,
        )

    def wait(self, sig: SignalArray, index: int, value: int, what: str) -> None:
        from torchrec_pgas.kernels.signal_wait import signal_wait

        peers = torch.tensor([index], dtype=torch.int32).to(self.device, non_blocking=True)
        signal_wait(sig.handle, peers, fixed(value, self.device), self.err, WAIT_DATA.value, self.timeout_ns)

    def check(self, context: Optional[str] = None) -> None:
        """Raises ``PgasTimeoutError`` if a device-side wait timed out (syncs the stream)."""
        record = self.err.tolist()
        if record[0]:
            self.err.zero_()
            raise self.timeout_error(record, context)

    def timeout_error(self, record: List[int], context: Optional[str] = None) -> PgasTimeoutError:
        """The error an error record (``[code, peer, what, value]``, code set) reports."""
        what = _WHAT.get(record[2], "a signal")
        return PgasTimeoutError(
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
