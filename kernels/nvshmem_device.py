"""NVSHMEM device functions for Triton kernels, as extern calls into the NVSHMEM
device bitcode (``libnvshmem_device.bc``, linked at compile time).

Pointers are passed as ``int64`` addresses (``ptr.to(tl.int64)``), as the bitcode
takes ``void *``. An extern call runs in every thread of the program: the ``*_block``
functions are written for that (the block cooperates on one operation); the
thread-scope ones used here (``signal_op`` with ``SIGNAL_SET``, ``fence``) are
idempotent when every thread issues them. A counted signal (``SIGNAL_ADD``) must be
issued once per program, so it rides on ``putmem_signal_nbi_block``, whose signal
one thread of the block sends after the block's data (also when there is none).

The constants are NVSHMEM's own (``nvshmem_defines.h``), not the ones some wrappers
document: over NVLink any signal op other than 9 behaves as an add.
"""

import functools

from triton.language import core

# NVSHMEM_SIGNAL_SET; NVSHMEM_SIGNAL_ADD is 10, the comparisons are EQ=0 NE=1 GT=2 LE=3
# LT=4 GE=5.
SIGNAL_SET = core.constexpr(9)
SIGNAL_ADD = core.constexpr(10)

_I32, _I64, _U64 = core.dtype("int32"), core.dtype("int64"), core.dtype("uint64")


@core.extern
def putmem_nbi_block(dest, source, nbytes, pe, _semantic=None):
    """``nvshmemx_putmem_nbi_block(void *dest, const void *source, size_t nbytes, int pe)``."""
    return core.extern_elementwise(
        "", "", [dest, source, nbytes, pe],
        {(_I64, _I64, _I64, _I32): ("nvshmemx_putmem_nbi_block", _I32)},
        is_pure=False, _semantic=_semantic,
    )


@core.extern
def putmem_signal_nbi_block(dest, source, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
    """``nvshmemx_putmem_signal_nbi_block(void *dest, const void *source, size_t nbytes,
    uint64_t *sig_addr, uint64_t signal, int sig_op, int pe)``."""
    return core.extern_elementwise(
        "", "", [dest, source, nbytes, sig_addr, signal, sig_op, pe],
        {(_I64, _I64, _I64, _I64, _U64, _I32, _I32): ("nvshmemx_putmem_signal_nbi_block", _I32)},
        is_pure=False, _semantic=_semantic,
    )


@core.extern
def signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    """``nvshmemx_signal_op(uint64_t *sig_addr, uint64_t signal, int sig_op, int pe)``."""
    return core.extern_elementwise(
        "", "", [sig_addr, signal, sig_op, pe],
        {(_I64, _U64, _I32, _I32): ("nvshmemx_signal_op", _I32)},
        is_pure=False, _semantic=_semantic,
    )


@core.extern
def fence(_semantic=None):
    """``nvshmem_fence()``: orders this thread's puts to each PE before later ones."""
    return core.extern_elementwise(
        "", "", [], {(): ("nvshmem_fence", _I32)}, is_pure=False, _semantic=_semantic
    )


@functools.lru_cache(maxsize=None)
def bitcode_libs() -> dict:
    """The ``extern_libs`` launch option that links NVSHMEM's device bitcode."""
    import os

    import nvidia.nvshmem

    path = os.path.join(list(nvidia.nvshmem.__path__)[0], "lib", "libnvshmem_device.bc")
    return {"libnvshmem_device": path}


#: Names of the kernels that call NVSHMEM: their modules need ``nvshmem.core.module_init``
#: before the first launch (and modules that do not call it must not get it).
KERNELS_USING_NVSHMEM: set = set()


def uses_nvshmem(kernel):
    """Marks a ``@triton.jit`` kernel as calling NVSHMEM device functions."""
    KERNELS_USING_NVSHMEM.add(kernel.fn.__name__)
    return kernel
