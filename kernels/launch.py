"""Launches of compiled Triton kernels without Triton's per-launch dispatch.

``JITFunction.run`` does a lot of Python on every launch (device and stream, binding
and specializing the arguments, the cache key, the check of global values, launch
metadata) before it calls the compiled kernel's launcher. A PGAS step launches about
ten kernels, and at typical batch sizes a step's time is the host's.

``Launcher`` sends a launch whose specialization it has seen straight to that compiled
kernel's launcher. It finds the specialization without Triton's binder where it can:
a parameter annotated with a type and listed in ``do_not_specialize`` always
specializes the same way (``("i64", None)``), so only the others (pointers, and ints
that are specialized) are specialized per launch, by Triton's own native function, and
the launch is keyed on those, the constexprs and the options. The first launch of each
specialization goes through Triton, which compiles the kernel and runs its post-compile
hooks (the NVSHMEM transport registers the kernel's module there). Under Triton's
interpreter, or with launch or pre-run hooks set (profilers), every launch goes through
Triton. Grids are tuples of ints (no callables), and globals the kernels read must not
change.

The fast path leans on Triton internals that carry no compatibility promise (the layout
of ``JITFunction.device_caches``, what its binder returns, ``native_specialize_impl``'s
arguments, the order of the C launcher's arguments), and a change there would not raise:
it would launch with misplaced arguments. So it is taken only on the Triton release it
was written and tested against, ``TESTED_TRITON``, matched exactly: a patch release may
change private internals, and a pre-release, development or locally labelled build
(``3.6.0+git...``) may be any commit. Any other Triton gets Triton's own
``kernel[grid](...)`` launch, which is always right and costs only host time.

``TORCHREC_PGAS_TRITON_LAUNCH=generic`` forces that generic launch on any version (to
rule the fast path out when chasing a fault, or to test the fallback); unset, empty or
``auto``, the version decides. It is read once, when this module is first imported.
"""

import functools
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import triton

#: The Triton release the fast path was written against (``triton==3.6.0`` is pinned).
TESTED_TRITON = "3.6.0"
#: The environment variable that forces Triton's own launch path (see the module docstring).
LAUNCH_ENV = "TORCHREC_PGAS_TRITON_LAUNCH"


def fast_path_supported(triton_version: str, choice: Optional[str]) -> bool:
    """Whether launches may skip Triton's dispatch under ``triton_version``, with
    ``choice`` the value of ``TORCHREC_PGAS_TRITON_LAUNCH`` (``None`` when unset)."""
    mode = (choice or "auto").strip().lower()
    if mode not in ("auto", "generic"):
        raise ValueError(f"{LAUNCH_ENV}={choice!r}: expected 'auto' (or unset) or 'generic'")
    return mode == "auto" and triton_version == TESTED_TRITON


#: Whether ``Launcher`` skips Triton's dispatch in this process.
FAST_PATH: bool = fast_path_supported(triton.__version__, os.environ.get(LAUNCH_ENV))

if FAST_PATH:
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl
    from triton.runtime.driver import driver


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids on the host: ``triton.cdiv`` is a constexpr function,
    whose call from Python goes through Triton's wrapper (unwrapping every argument)
    rather than being one integer operation."""
    return -(-a // b)


def rows_adjacent(t: torch.Tensor) -> bool:
    """Whether each row of ``t`` (2-D) has its elements adjacent, whatever the stride
    between rows: what a kernel reading rows at their row stride needs."""
    return t.size(1) <= 1 or t.stride(1) == 1


def strided_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) as rows a kernel reads at its row stride: ``t`` itself where its rows'
    elements are adjacent (``rows_adjacent``; also a column slice of a wider tensor, as
    the backward of ``torch.cat`` hands each sharding its part of a module's gradient),
    else a contiguous copy."""
    return t if rows_adjacent(t) else t.contiguous()


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` on the host, without its call's cost (see ``cdiv``)."""
    return 1 << max(n - 1, 0).bit_length()


def _frozen(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def _options_key(kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    key = tuple(kwargs.items())
    try:
        hash(key)
    except TypeError:  # a dict option (``extern_libs``)
        key = tuple((k, _frozen(v)) for k, v in kwargs.items())
    return key


def _fixed(param: Any) -> bool:
    """Whether Triton's binder specializes ``param`` the same way whatever its value."""
    ty = param.annotation_type
    return bool(ty) and (param.do_not_specialize or ty == "u1" or ty[:2] in ("fp", "bf"))


class Launcher:
    """``Launcher(kernel)[grid](*args, **kwargs)`` launches as ``kernel[grid](...)`` does.

    It skips Triton's dispatch where ``FAST_PATH`` allows; ``fast=False`` hands every
    launch to Triton whatever the version.
    """

    def __init__(self, kernel: Any, *, fast: bool = True) -> None:
        self._kernel = kernel
        self._fast = FAST_PATH and fast
        if not self._fast:
            return
        self._compiled: Dict[Tuple[Any, ...], Any] = {}
        # Launches keyed without the binder: the launch and its constexprs' values.
        self._keyed: Dict[Tuple[Any, ...], Tuple[Callable[..., None], Tuple[Any, ...]]] = {}
        params = getattr(kernel, "params", [])
        runtime = [p for p in params if not p.is_constexpr]
        # Only launches that pass every runtime parameter positionally, constexprs last.
        self._positional: Optional[int] = len(runtime) if params[: len(runtime)] == runtime else None
        self._loose = tuple(
            (p.num, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
            for p in runtime
            if not _fixed(p)
        )

    def __getitem__(self, grid: Tuple[int, ...]) -> Callable[..., None]:
        if not self._fast:
            return self._kernel[grid]
        return functools.partial(self._launch, grid)

    def _launch(self, grid: Tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        kernel = self._kernel
        caches = getattr(kernel, "device_caches", None)
        # (Triton's hooks are HookChains, never None: a chain with calls is set.)
        hooked = knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls
        if caches is None or hooked or kernel.pre_run_hooks:
            kernel[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        keyed = None
        if len(args) == self._positional and device in caches:
            backend = caches[device][3]
            # Triton's key also holds the two knobs it adds to the options on every launch.
            keyed = (
                device,
                tuple([native_specialize_impl(backend, args[i], c, s, a) for i, c, s, a in self._loose]),
                _options_key(kwargs),
                knobs.runtime.debug,
                knobs.compilation.instrumentation_mode,
            )
            hit = self._keyed.get(keyed)
            if hit is not None:
                launch, constexprs = hit
                launch(g0, g1, g2, driver.active.get_current_stream(device), *args, *constexprs)
                return
        bound, specialization, options = caches[device][4](*args, **kwargs)
        key = (
            device,
            tuple(specialization),
            _options_key(options),
            knobs.runtime.debug,
            knobs.compilation.instrumentation_mode,
        )
        launch = self._compiled.get(key)
        if launch is None:
            self._compiled[key] = _direct(kernel[grid](*args, **kwargs))
            return
        if keyed is not None:
            self._keyed[keyed] = (launch, tuple(bound.values())[len(args) :])
        launch(g0, g1, g2, driver.active.get_current_stream(device), *bound.values())


def _direct(compiled: Any) -> Callable[..., None]:
    """``compiled``'s launch: its launcher's own (C) call where the kernel needs no
    scratch memory, which the launcher's Python wrapper would allocate per launch."""
    run = compiled.run
    if getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0) or not hasattr(run, "launch"):
        return lambda g0, g1, g2, stream, *args: run(
            g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args
        )
    fixed = (
        compiled.function,
        run.launch_cooperative_grid,
        run.launch_pdl,
        None,
        None,
        compiled.packed_metadata,
        None,
        None,
        None,
    )
    return lambda g0, g1, g2, stream, *args: run.launch(g0, g1, g2, stream, *fixed, *args)
