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
        "",
        "",
        [dest, source, nbytes, pe],
        {(_I64, _I64, _I64, _I32): ("nvshmemx_putmem_nbi_block", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def putmem_signal_nbi_block(dest, source, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
    """``nvshmemx_putmem_signal_nbi_block(void *dest, const void *source, size_t nbytes,
    uint64_t *sig_addr, uint64_t signal, int sig_op, int pe)``."""
    return core.extern_elementwise(
        "",
        "",
        [dest, source, nbytes, sig_addr, signal, sig_op, pe],
        {(_I64, _I64, _I64, _I64, _U64, _I32, _I32): ("nvshmemx_putmem_signal_nbi_block", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    """``nvshmemx_signal_op(uint64_t *sig_addr, uint64_t signal, int sig_op, int pe)``."""
    return core.extern_elementwise(
        "",
        "",
        [sig_addr, signal, sig_op, pe],
        {(_I64, _U64, _I32, _I32): ("nvshmemx_signal_op", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def fence(_semantic=None):
    """``nvshmem_fence()``: orders this thread's puts to each PE before later ones."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def quiet(_semantic=None):
    """``nvshmem_quiet()``: completes this thread's puts and signals (delivered at the
    target, sources reusable)."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_quiet", _I32)}, is_pure=False, _semantic=_semantic)


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


#: Names of the kernels that call NVSHMEM only when compiled with ``PUT_PATH=True`` (their
#: path for peers without a peer mapping); compiled without it, they must not get
#: ``module_init``. ``needs_module_init`` tells the two apart.
KERNELS_WITH_PUT_PATH: set = set()


def has_put_path(kernel):
    """Marks a ``@triton.jit`` kernel as calling NVSHMEM when compiled with ``PUT_PATH``."""
    KERNELS_WITH_PUT_PATH.add(kernel.fn.__name__)
    return kernel


def needs_module_init(name: str, metadata_group: dict) -> bool:
    """Whether the compiled kernel ``name`` (``metadata_group``: its cache files, name to
    path, as Triton's kernel-load hooks get them) calls NVSHMEM, so needs
    ``nvshmem.core.module_init`` before its first launch. One kernel's two variants differ
    (``PUT_PATH``), and only the variant's code says which it is: NVSHMEM's device state
    is referenced exactly when NVSHMEM is called."""
    if name in KERNELS_USING_NVSHMEM:
        return True
    if name not in KERNELS_WITH_PUT_PATH:
        return False
    ptx = next((path for file, path in metadata_group.items() if file.endswith(".ptx")), None)
    if ptx is None:
        return True  # cannot tell: the init of a module that does not need it fails loudly
    with open(ptx) as f:
        return "nvshmemi_device_state_d" in f.read()


def put_path_options(name: str, table, shape: tuple) -> dict:
    """The launch options of a kernel's ``PUT_PATH`` variant, once its put-path table
    ``table`` (argument ``name``) is checked to be a contiguous int64 tensor of ``shape``:
    the kernels read it by position, so a wrong shape would put data in wrong places
    rather than fail."""
    import torch

    if table.dtype != torch.int64 or tuple(table.shape) != tuple(shape) or not table.is_contiguous():
        raise ValueError(
            f"{name}: the put path takes a contiguous int64 {list(shape)} table, got a "
            f"{'' if table.is_contiguous() else 'non-contiguous '}{table.dtype} {list(table.shape)}"
        )
    return {"PUT_PATH": True, "extern_libs": bitcode_libs()}
