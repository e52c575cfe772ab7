"""``Launcher`` hands the compiled kernel's launcher exactly what Triton's own launch
does, and compiles (or reuses) exactly when Triton does. Without a GPU: a stand-in
driver, and a stand-in compile that records each compiled variant and the launches."""

from typing import Iterator, Tuple

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import jit  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from torchrec_pgas.kernels.launch import Launcher, strided_rows  # noqa: E402


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 777

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _CudaLauncher:
    """Triton's ``CudaLauncher``: its call allocates the scratch memory a kernel needs
    (none by default) and hands everything to ``launch``, the C launcher."""

    launch_cooperative_grid, launch_pdl, global_scratch_size, profile_scratch_size = False, True, 0, 0

    def __init__(self, record):
        self._record = record

    def launch(
        self, g0, g1, g2, stream, function, coop, pdl, scratch, profile_scratch, packed, metadata, enter, exit, *args
    ):
        self._record((g0, g1, g2, stream, function, coop, pdl, scratch, profile_scratch, packed) + args)

    def __call__(self, g0, g1, g2, stream, function, *args):
        scratch = "scratch" if self.global_scratch_size else None
        self.launch(g0, g1, g2, stream, function, self.launch_cooperative_grid, self.launch_pdl, scratch, None, *args)


class _Compiled:
    """A compiled variant: ``launches`` gets what reaches the C launcher, hooks left out."""

    def __init__(self, number, launches):
        self.number, self.function, self.packed_metadata = number, 0xF00 + number, (4, 1, 0)
        self.run = _CudaLauncher(lambda args: launches.append((number, args)))

    def launch_metadata(self, grid, stream, *args):
        return None


@pytest.fixture
def launches(monkeypatch):
    """The launches of ``_kernel``'s variants, in order, as ``(variant, arguments)``,
    each after ``("through Triton", None)`` if it went through ``JITFunction.run``."""
    launches, variants = [], []

    def compile_(self, key, signature, device, constexprs, options, attrs, warmup):
        variants.append(key)
        compiled = self.device_caches[device][0][key] = _Compiled(len(variants), launches)
        return compiled

    monkeypatch.setattr(jit.JITFunction, "_do_compile", compile_)
    run = jit.JITFunction.run

    def counted_run(self, *args, **kwargs):
        launches.append(("through Triton", None))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "run", counted_run)
    monkeypatch.setattr(driver, "_active", _Driver())
    _kernel.device_caches.clear()
    _typed_kernel.device_caches.clear()
    return launches


class _Pointer:
    def __init__(self, address, dtype=torch.float32):
        self.dtype, self._address = dtype, address

    def data_ptr(self):
        return self._address


@triton.jit(do_not_specialize=["n"])
def _kernel(x_ptr, y_ptr, a, n, opt, BLOCK: tl.constexpr, FLAG: tl.constexpr = 0):
    pass


CALLS = [
    ((_Pointer(1024), _Pointer(2048), 1, 5, None), dict(BLOCK=64, num_warps=2)),
    (
        (_Pointer(1024), _Pointer(2048), 17, 1, _Pointer(16, torch.int64)),
        dict(BLOCK=64, FLAG=3, extern_libs={"lib": "/x.bc"}),
    ),
    ((_Pointer(1032), _Pointer(2048), 16, 2**40, 2.5), dict(BLOCK=32)),  # x not 16-byte aligned
    ((_Pointer(1024), _Pointer(2048), 1, 5, None), dict(BLOCK=64, num_warps=4)),
]


def _launch_each_call_thrice(launcher: Launcher, launches: list) -> Iterator[Tuple[tuple, tuple, list]]:
    """For each of ``CALLS``: the call, the launch Triton itself makes of it, and what
    three launches of it through ``launcher`` recorded after that."""
    for call in CALLS:
        args, kwargs = call
        launches.clear()
        _kernel[(3, 2)](*args, **kwargs)
        expected = launches[-1]
        for _ in range(3):
            launcher[(3, 2)](*args, **kwargs)
        yield call, expected, launches[2:]


def test_launches_are_triton_launches(launches):
    for call, expected, recorded in _launch_each_call_thrice(Launcher(_kernel), launches):
        # The first launch through Triton (the variant's compile), then direct ones.
        assert recorded == [("through Triton", None), expected, expected, expected], call


def test_the_generic_launch_is_tritons_own(launches, monkeypatch):
    """``fast=False`` (on a Triton the fast path was not written for, or when
    ``TORCHREC_PGAS_TRITON_LAUNCH=generic``) sends every launch through Triton."""
    monkeypatch.setattr(Launcher, "_launch", lambda *a, **k: pytest.fail("the fast path ran"))
    for call, expected, recorded in _launch_each_call_thrice(Launcher(_kernel, fast=False), launches):
        assert recorded == [("through Triton", None), expected] * 3, call


@triton.jit(do_not_specialize=["n", "m"])
def _typed_kernel(x_ptr, n: tl.int64, a, m: tl.int64, BLOCK: tl.constexpr, FLAG: tl.constexpr = 0):
    pass


TYPED_CALLS = [
    ((_Pointer(1024), 5, 1, 7), dict(BLOCK=64)),
    ((_Pointer(1024), 2**40, 1, -3), dict(BLOCK=64)),  # the typed ints: the same variant
    ((_Pointer(1032), 5, 1, 7), dict(BLOCK=64)),  # x not 16-byte aligned
    ((_Pointer(1024), 5, 16, 7), dict(BLOCK=64)),  # a specialized otherwise
    ((_Pointer(1024, torch.int64), 5, 1, 7), dict(BLOCK=64)),
    ((_Pointer(1024), 5, 1, 7), dict(BLOCK=64, FLAG=2)),
    ((_Pointer(1024), 5, 1, 7), dict(BLOCK=64, num_warps=8)),
    ((_Pointer(1024), 5, 1, 7), dict(BLOCK=64, extern_libs={"lib": "/x.bc"})),
]


def test_launches_keyed_without_the_binder_are_triton_launches(launches):
    """A kernel whose ints are typed and unspecialized: once a specialization has been
    launched, launches of it skip Triton's binder, and reach the C launcher exactly as
    Triton's own launches do, with the variant Triton picks."""
    launcher, through = Launcher(_typed_kernel), ("through Triton", None)
    variants = []
    for args, kwargs in TYPED_CALLS:
        launches.clear()
        _typed_kernel[(3, 2)](*args, **kwargs)
        expected = launches[-1]
        variants.append(expected[0])
        cache, keys, target, backend, binder = _typed_kernel.device_caches[0]
        binds = []
        _typed_kernel.device_caches[0] = (
            cache,
            keys,
            target,
            backend,
            lambda *a, **k: binds.append(1) or binder(*a, **k),
        )
        counts = []
        for _ in range(4):
            launcher[(3, 2)](*args, **kwargs)
            counts.append(len(binds))
        _typed_kernel.device_caches[0] = (cache, keys, target, backend, binder)
        ours = launches[2:]
        assert ours in ([expected] * 4, [through] + [expected] * 4), (args, kwargs)
        assert counts[1] == counts[3], (args, kwargs)  # from the third launch on, no binder
    # The typed ints take no variant of their own; every other change does.
    assert variants[0] == variants[1] and len(set(variants[1:])) == len(variants) - 1, variants


def test_kernels_with_scratch_memory_get_it(launches, monkeypatch):
    """A kernel that needs scratch memory is launched through the launcher's own call,
    which allocates it."""
    monkeypatch.setattr(_CudaLauncher, "global_scratch_size", 64)
    launcher, (args, kwargs) = Launcher(_kernel), CALLS[0]
    for _ in range(2):
        launcher[(3, 2)](*args, **kwargs)
    assert [n for n, _ in launches] == ["through Triton", 1, 1]
    assert launches[1] == launches[2] and launches[2][1][7] == "scratch"


def test_a_knob_triton_keys_on_gets_its_own_variant(launches):
    launcher, args = Launcher(_kernel), CALLS[0][0]
    launcher[(1,)](*args, BLOCK=8)
    launcher[(1,)](*args, BLOCK=8)
    knobs.runtime.debug = True
    try:
        launcher[(1,)](*args, BLOCK=8)
        launcher[(1,)](*args, BLOCK=8)
    finally:
        knobs.runtime.debug = False
    assert [n for n, _ in launches] == ["through Triton", 1, 1, "through Triton", 2, 2]


def test_grids_keep_cuda_limits_at_large_batches(monkeypatch):
    """CUDA takes at most 65535 programs on a grid's second and third axes: the blocks
    of bags go on the first (65536 samples per rank with the default headroom of 2
    once put 65536 blocks on the second)."""
    from torchrec_pgas.kernels import lookup_put
    from torchrec_pgas.kernels.ids_slot import IdsSlotLayout

    grids = []

    class _Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(lookup_put, "_launcher", _Recorder())
    layout = IdsSlotLayout(max_features=8, batch_capacity=4 * 131072, ids_capacity=1)
    t = torch.zeros(8, dtype=torch.int64)
    lookup_put.lookup_put(
        t,
        t[:1],
        t[:1],
        t,
        torch.zeros(8, 4, dtype=torch.int64),
        torch.zeros(1),
        torch.zeros(0, 1024),
        0,
        t.view(1, 8),
        t,
        t,
        t,
        t,
        layout,
        1024,
        False,
        10**9,
    )
    (grid,) = grids
    assert grid[0] * lookup_put.BLOCK_B >= layout.batch_capacity
    assert max(grid[1:]) <= 65535, grid


def test_strided_rows_keeps_rows_whose_elements_are_adjacent():
    """A kernel reads rows at their stride: a column slice of a wider tensor (and a
    row broadcast over the batch) is passed as it is, its storage shared; columns whose
    elements are not adjacent are copied into contiguous rows of the same values."""
    wide = torch.randn(6, 20)
    for t in (wide, wide[:, 4:12], wide[2:5, 8:], torch.randn(1, 8).expand(5, 8), wide[:, 3:4]):
        assert strided_rows(t) is t
    for t in (wide.t(), wide[:, ::2], torch.randn(5, 1).expand(5, 8)):
        rows = strided_rows(t)
        assert rows.is_contiguous() and torch.equal(rows, t) and rows.data_ptr() != t.data_ptr()
