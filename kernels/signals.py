"""Device helpers shared by the kernels: a signal wait with a timeout, the count of a
launch's finished programs, and the count-in of stored rows, through a peer mapping or
(``put_rows``, ``signal_put``) through NVSHMEM for a peer without one.

NVSHMEM's own ``nvshmem_signal_wait_until`` cannot time out, and a kernel that spins
forever hangs the process with no message. These helpers spin with an acquire load
and give up after ``timeout_ns``, recording which wait failed in an error record that
the step's record carries to the host (``[code, peer, what, value]``, int64).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from torchrec_pgas.kernels import nvshmem_device as nv

#: What a wait was for, the third word of an error record.
WAIT_SLOT_FREE = tl.constexpr(1)
WAIT_OUT_FREE = tl.constexpr(2)
WAIT_DATA = tl.constexpr(3)


@triton.jit
def wait_ge(sig_ptr, target, timeout_ns, err_ptr, peer, what):
    """Spins until ``*sig_ptr >= target``; returns whether it got there in time."""
    value = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")
    # The clock only when the signal is not there yet (most waits; also what lets
    # Triton's interpreter, which cannot read it, run the kernels past a wait).
    if value < target:
        start = globaltimer()
        elapsed = start - start
        while (value < target) & (elapsed < timeout_ns):
            value = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")
            elapsed = globaltimer() - start
    ok = value >= target
    if not ok:
        tl.store(err_ptr, 1)
        tl.store(err_ptr + 1, peer)
        tl.store(err_ptr + 2, what)
        tl.store(err_ptr + 3, target)
    return ok


@triton.jit
def last_to_finish(counter_ptr, total):
    """Counts this program in on ``*counter_ptr`` (acquire-release at GPU scope: a
    launch's programs share the GPU) and returns whether it is the last of ``total``;
    the last leaves the counter at zero for the next launch (stream ordered)."""
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") + 1 == total
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def count_in(cnt_addrs_ptr, s):
    """Adds one to requester ``s``'s counter word for this rank (``cnt_addrs[s]``, an
    address through the peer mapping), with release semantics at system scope: the
    rows this program stored before are visible to whoever sees the count."""
    cnt = tl.load(cnt_addrs_ptr + s).to(tl.pointer_type(tl.int64), bitcast=True)
    tl.atomic_add(cnt, 1, sem="release", scope="sys")


@triton.jit
def put_rows(dst, src, stride, row_bytes, first, n, pe):
    """Puts rows ``first ... first + n - 1`` of ``row_bytes`` bytes, one every ``stride``
    bytes from ``src`` (local, symmetric: a network put reads its source from the
    symmetric heap) to ``dst`` (symmetric) on PE ``pe``: non-blocking, the block
    cooperating on each row. ``nv.quiet()`` completes them."""
    for i in range(n):
        at = (first + i).to(tl.int64) * stride
        nv.putmem_nbi_block(dst + at, src + at, row_bytes, pe)


@triton.jit
def signal_put(sig, value, op, pe):
    """Applies ``op`` (``nv.SIGNAL_SET`` or ``nv.SIGNAL_ADD``) with ``value`` to the
    signal word at symmetric address ``sig`` on PE ``pe``, once per program: an extern
    runs in every thread, and a put-with-signal of no bytes is the block operation whose
    signal one thread sends. It is ordered after nothing: ``nv.quiet()`` before it
    completes the puts it publishes."""
    nothing = tl.full((), 0, tl.int64)
    nv.putmem_signal_nbi_block(sig, sig, nothing, sig, tl.cast(value, tl.uint64), op, pe)
