"""Which torch, FBGEMM and TorchRec releases work together.

FBGEMM's wheels (``fbgemm-gpu`` and ``fbgemm-gpu-cpu``) are built against one torch
release each and fail to load (undefined symbols) or misbehave beside any other, yet
their metadata does not say which: a resolver left alone pairs the newest of each. The
package's extras pin tested sets; ``check_versions()`` names a wrong pair clearly instead
of leaving it to a loader error deep inside an import. Imports only the standard library.
"""

import re
import warnings
from importlib import metadata
from typing import Dict, Optional, Tuple

Release = Tuple[int, int]

#: FBGEMM (major, minor) -> the torch (major, minor) its wheels are built for. TorchRec's
#: (major, minor) is FBGEMM's.
FBGEMM_TORCH: Dict[Release, Release] = {
    (1, 6): (2, 11),
    (1, 7): (2, 12),
    (1, 8): (2, 13),
    (1, 9): (2, 14),
}

#: The FBGEMM distributions: the CUDA build and the CPU build (both install ``fbgemm_gpu``).
FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu")


def release(version: str) -> Optional[Release]:
    """``(major, minor)`` of a version string (``"2.13.0+cpu"`` -> ``(2, 13)``), or
    ``None`` if it does not start with two numbers."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _name(r: Release) -> str:
    return f"{r[0]}.{r[1]}"


def pair_problem(
    torch: str, fbgemm: str, torchrec: Optional[str] = None, fbgemm_name: str = "fbgemm-gpu"
) -> Optional[str]:
    """Why the given versions do not work together, or ``None`` if they are a known pair.

    Raises:
        LookupError: if FBGEMM's release is not in ``FBGEMM_TORCH`` (nothing to check against).
    """
    fb = release(fbgemm)
    if fb not in FBGEMM_TORCH:
        raise LookupError(f"{fbgemm_name} {fbgemm} is not in torchrec_pgas.compat.FBGEMM_TORCH")
    wanted = FBGEMM_TORCH[fb]
    if release(torch) != wanted:
        fits = [f for f, t in FBGEMM_TORCH.items() if t == release(torch)]
        other = f" or {fbgemm_name} {_name(fits[0])} for torch {torch}" if fits else ""
        return (
            f"{fbgemm_name} {fbgemm} is built for torch {_name(wanted)}, but torch {torch} is installed: "
            f"install torch {_name(wanted)}{other} (pip install 'torchrec-pgas[gpu]' or '[cpu]' installs a tested set)"
        )
    if torchrec is not None and release(torchrec) != fb:
        return (
            f"torchrec {torchrec} goes with FBGEMM {_name(release(torchrec) or (0, 0))}, but {fbgemm_name} {fbgemm} "
            f"is installed: install torchrec {_name(fb)}"
        )
    return None


def _installed(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions() -> None:
    """Check that the installed torch, FBGEMM and TorchRec are a known working set.

    A release newer than ``FBGEMM_TORCH`` knows gets a warning, not an error: it may
    well work, it is just untested here.

    Raises:
        RuntimeError: naming the installed versions and the pair they should be, if
            FBGEMM was built for another torch, TorchRec goes with another FBGEMM, or
            both FBGEMM builds are installed (they overwrite each other's files).
    """
    fbgemms = {name: v for name in FBGEMM_DISTRIBUTIONS if (v := _installed(name)) is not None}
    if len(fbgemms) > 1:
        found = " and ".join(f"{n} {v}" for n, v in fbgemms.items())
        raise RuntimeError(f"{found} are both installed; they share the module fbgemm_gpu: keep one")
    torch, torchrec = _installed("torch"), _installed("torchrec")
    if not fbgemms or torch is None:
        return  # nothing to pair; the import that needs it says so
    ((fbgemm_name, fbgemm),) = fbgemms.items()
    try:
        problem = pair_problem(torch, fbgemm, torchrec, fbgemm_name)
    except LookupError:
        warnings.warn(
            f"{fbgemm_name} {fbgemm} with torch {torch} is not a pair torchrec_pgas was tested with "
            f"(torchrec_pgas.compat.FBGEMM_TORCH)",
            stacklevel=2,
        )
        return
    if problem is not None:
        raise RuntimeError(problem)
