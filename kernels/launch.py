"""Launches of compiled Triton kernels without Triton's per-launch dispatch.

``JITFunction.run`` spends tens of microseconds of Python on every launch (device and
stream, binding and specializing the arguments, the cache key, the check of global
values, launch metadata) before it calls the compiled kernel's launcher. A PGAS step
launches about ten kernels, and at R1 the step time is the host's time.

``Launcher`` keeps Triton's own specialization of the arguments (its binder, a native
function), and sends a launch whose specialization it has seen straight to that
compiled kernel's launcher. The first launch of each specialization goes through
Triton, which compiles the kernel and runs its post-compile hooks (the NVSHMEM
transport registers the kernel's module there). Under Triton's interpreter, or with
launch or pre-run hooks set (profilers), every launch goes through Triton. Grids are
tuples of ints (no callables), and globals the kernels read must not change.
"""

import functools
from typing import Any, Callable, Dict, Tuple

from triton import knobs
from triton.runtime.driver import driver


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids on the host: ``triton.cdiv`` is a constexpr function,
    whose call from Python costs microseconds."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` on the host, without its call's cost (see ``cdiv``)."""
    return 1 << max(n - 1, 0).bit_length()


def _frozen(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


class Launcher:
    """``Launcher(kernel)[grid](*args, **kwargs)`` launches as ``kernel[grid](...)`` does."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._compiled: Dict[Tuple[Any, ...], Any] = {}

    def __getitem__(self, grid: Tuple[int, ...]) -> Callable[..., None]:
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
        bound, specialization, options = caches[device][4](*args, **kwargs)
        # Triton's key also holds the two knobs it adds to the options on every launch.
        key = (
            device, tuple(specialization), tuple((k, _frozen(v)) for k, v in options.items()),
            knobs.runtime.debug, knobs.compilation.instrumentation_mode,
        )
        launch = self._compiled.get(key)
        if launch is None:
            self._compiled[key] = _direct(kernel[grid](*args, **kwargs))
            return
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        launch(g0, g1, g2, driver.active.get_current_stream(device), *bound.values())


def _direct(compiled: Any) -> Callable[..., None]:
    """``compiled``'s launch: its launcher's own (C) call where the kernel needs no
    scratch memory, which the launcher's Python wrapper would allocate per launch."""
    run = compiled.run
    if getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0) or not hasattr(run, "launch"):
        return lambda g0, g1, g2, stream, *args: run(
            g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args
        )
    fixed = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
    return lambda g0, g1, g2, stream, *args: run.launch(g0, g1, g2, stream, *fixed, *args)
