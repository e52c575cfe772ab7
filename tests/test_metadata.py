"""The package metadata installs a set that works together: each extra pins torch,
FBGEMM, TorchRec, Triton and NVSHMEM to a pair ``torchrec_pgas.compat`` knows, the
Makefile installs those very pins, and ``register()`` names a wrong pair."""

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List

import pytest

from torchrec_pgas import compat

tomllib = pytest.importorskip("tomllib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = ("gpu", "cpu")
FBGEMM = {"gpu": "fbgemm-gpu", "cpu": "fbgemm-gpu-cpu"}


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _requirements(which: str) -> List[str]:
    """What the set ``which`` installs: its extra, then what goes in without dependencies."""
    project = _pyproject()
    return project["project"]["optional-dependencies"][which] + project["tool"]["torchrec-pgas"].get(
        f"{which}-no-deps", []
    )


def _pins(which: str) -> Dict[str, str]:
    return {_name(r): r.split("==", 1)[1] for r in _requirements(which) if "==" in r}


@pytest.mark.parametrize("which", SETS)
def test_each_set_pins_a_known_pair(which):
    from torchrec_pgas.kernels.launch import TESTED_TRITON

    pins = _pins(which)
    fbgemm = FBGEMM[which]
    for name in ("torch", fbgemm, "torchrec", "triton", "nvidia-nvshmem-cu13"):
        assert name in pins, f"the {which} set does not pin {name}: {_requirements(which)}"
    names = {_name(r) for r in _requirements(which)}
    assert [f for f in FBGEMM.values() if f in names] == [fbgemm], "one FBGEMM build per set"
    assert compat.pair_problem(pins["torch"], pins[fbgemm], pins["torchrec"], fbgemm) is None
    assert pins["triton"] == TESTED_TRITON, "the Triton the launcher's fast path was written for"


def test_the_core_requirements_pin_nothing_an_extra_pins():
    """Anything of a set in the core requirements would be installed unpinned beside
    the other set, or (torchrec) drag the CUDA FBGEMM onto CPU machines."""
    core = {_name(r) for r in _pyproject()["project"]["dependencies"]}
    for which in SETS:
        assert not core & set(_pins(which)), which


def test_the_cpu_extra_brings_what_torchrec_needs_but_the_cuda_fbgemm():
    """TorchRec goes in without its dependencies on CPUs: the extra lists them instead."""
    from importlib import metadata

    pinned = _pins("cpu")["torchrec"]
    try:
        installed = metadata.version("torchrec")
    except metadata.PackageNotFoundError:
        pytest.skip("torchrec is not installed")
    if installed != pinned:
        pytest.skip(f"torchrec {installed} is installed, not the pinned {pinned}")
    needed = {_name(r) for r in metadata.requires("torchrec") or [] if "extra ==" not in r}
    assert needed - {"fbgemm-gpu"} <= {_name(r) for r in _requirements("cpu")} | {
        _name(r) for r in _pyproject()["project"]["dependencies"]
    }


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("which, gpus", [("cpu", "0"), ("gpu", "2")])
def test_the_makefile_installs_the_pins_of_pyproject(which, gpus):
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert "==" not in makefile, "the Makefile pins nothing itself: the pins live in pyproject.toml"
    steps = subprocess.run(
        ["make", "-s", "-n", "-B", "install", f"GPUS={gpus}", f"PY={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f'-e ".[{which},' in steps, steps
    # The no-deps step reads the pins from pyproject.toml and installs exactly them.
    (no_deps,) = [line for line in steps.splitlines() if "no_deps=" in line]
    shown = subprocess.run(
        ["bash", "-c", no_deps.split(" && ")[0] + ' && echo "$no_deps"'], cwd=ROOT, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == _pyproject()["tool"]["torchrec-pgas"].get(f"{which}-no-deps", [])


def _fake_versions(monkeypatch, **versions):
    def version(name):
        key = name.lower().replace("-", "_")
        if key not in versions:
            raise compat.metadata.PackageNotFoundError(name)
        return versions[key]

    monkeypatch.setattr(compat.metadata, "version", version)


@pytest.mark.parametrize(
    "versions, message",
    [
        # The set a resolver picks on its own (the issue): FBGEMM 1.9 is built for torch 2.14.
        (
            dict(torch="2.13.0", fbgemm_gpu="1.9.0", torchrec="1.9.2"),
            r"fbgemm-gpu 1\.9\.0 is built for torch 2\.14, but torch 2\.13\.0 is installed: "
            r"install torch 2\.14 or fbgemm-gpu 1\.8 for torch 2\.13\.0",
        ),
        (
            dict(torch="2.11.0+cu130", fbgemm_gpu_cpu="1.8.0", torchrec="1.8.0"),
            r"fbgemm-gpu-cpu 1\.8\.0 is built for torch 2\.13, but torch 2\.11\.0\+cu130 .* fbgemm-gpu-cpu 1\.6",
        ),
        (
            dict(torch="2.13.0+cpu", fbgemm_gpu_cpu="1.8.0", torchrec="1.9.2"),
            r"torchrec 1\.9\.2 goes with FBGEMM 1\.9, but fbgemm-gpu-cpu 1\.8\.0 is installed: install torchrec 1\.8",
        ),
        (
            dict(torch="2.13.0", fbgemm_gpu="1.8.0", fbgemm_gpu_cpu="1.8.0", torchrec="1.8.0"),
            r"fbgemm-gpu 1\.8\.0 and fbgemm-gpu-cpu 1\.8\.0 are both installed",
        ),
    ],
)
def test_register_names_a_wrong_pair(monkeypatch, versions, message):
    from torchrec_pgas.planner import registration

    _fake_versions(monkeypatch, **versions)
    with pytest.raises(RuntimeError, match=message):
        compat.check_versions()
    was = registration.is_registered()
    with pytest.raises(RuntimeError, match=message):
        registration.register()
    assert registration.is_registered() == was


def test_known_pairs_pass_and_newer_ones_warn(monkeypatch, recwarn):
    for (fb_major, fb_minor), (t_major, t_minor) in compat.FBGEMM_TORCH.items():
        _fake_versions(
            monkeypatch,
            torch=f"{t_major}.{t_minor}.1+cu130",
            fbgemm_gpu=f"{fb_major}.{fb_minor}.0",
            torchrec=f"{fb_major}.{fb_minor}.2",
        )
        compat.check_versions()
    assert not recwarn.list
    _fake_versions(monkeypatch, torch="2.15.0", fbgemm_gpu="1.10.0", torchrec="1.10.0")
    with pytest.warns(UserWarning, match=r"fbgemm-gpu 1\.10\.0 with torch 2\.15\.0 is not a pair"):
        compat.check_versions()


def test_the_installed_set_is_a_known_pair():
    compat.check_versions()


@pytest.mark.slow
@pytest.mark.parametrize("which", SETS)
def test_a_resolver_installs_exactly_the_pins(which, tmp_path):
    """pip, as a new user runs it (a dry run from this tree, needs the package index),
    resolves each set to its pins with nothing conflicting."""
    apart = {_name(r) for r in _pyproject()["tool"]["torchrec-pgas"].get(f"{which}-no-deps", [])}
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--report",
            str(report),
            f".[{which}]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = {
        _name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    for name, version in _pins(which).items():
        if name not in apart:
            assert resolved.get(name, "").split("+")[0] == version, (name, resolved.get(name), version)
