"""The kernels work through Triton's own launch path, which ``Launcher`` falls back to
on a Triton other than the one its fast path was written for: the interpreter and
compile tests run with ``TORCHREC_PGAS_TRITON_LAUNCH=generic`` (the first case of each
test, to keep CI time modest), in processes of their own since the choice is made at
import, with the fast path replaced by a call that fails the test."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from torchrec_pgas.kernels import launch  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))

# Runs pytest on the files given with the fast path made to fail, the first case of each
# test function only; prints the number of launches the Launchers handed to Triton.
_RUNNER = """
import sys

import pytest

from torchrec_pgas.kernels import launch

assert not launch.FAST_PATH, "TORCHREC_PGAS_TRITON_LAUNCH=generic left the fast path on"
launches = []


def _fast_path(self, grid, *args, **kwargs):
    raise AssertionError("the fast path ran although the generic launch was forced")


def _counted(self, grid, _getitem=launch.Launcher.__getitem__):
    launches.append(grid)
    return _getitem(self, grid)


launch.Launcher._launch = _fast_path
launch.Launcher.__getitem__ = _counted


class FirstCaseOfEachTest:
    def pytest_collection_modifyitems(self, config, items):
        seen, kept, dropped = set(), [], []
        for item in items:
            name = getattr(item, "originalname", item.name)
            (dropped if name in seen else kept).append(item)
            seen.add(name)
        items[:] = kept
        config.hook.pytest_deselected(items=dropped)


code = pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[FirstCaseOfEachTest()])
print(f"generic launches: {len(launches)}")
sys.exit(code)
"""


def test_the_launch_choice_is_read_from_the_environment():
    """The generic launch on request; otherwise the version decides, exactly."""
    assert launch.fast_path_supported(launch.TESTED_TRITON, None)
    assert launch.fast_path_supported(launch.TESTED_TRITON, "auto")
    assert launch.fast_path_supported(launch.TESTED_TRITON, "")
    assert not launch.fast_path_supported(launch.TESTED_TRITON, "generic")
    assert not launch.fast_path_supported(launch.TESTED_TRITON, " Generic ")
    for other in ("3.6.1", "3.7.0", "3.5.1", "4.0.0", "3.6.0rc1", "3.6.0.dev20260101", "3.6.0+git1234abcd", "3.6"):
        assert not launch.fast_path_supported(other, None), other
    with pytest.raises(ValueError, match="TORCHREC_PGAS_TRITON_LAUNCH='fast'.*'generic'"):
        launch.fast_path_supported(launch.TESTED_TRITON, "fast")


@pytest.mark.parametrize(
    "file, interpret, min_launches",
    [("test_kernels_interpreted.py", "1", 10), ("test_kernels_compile.py", None, 0)],
)
def test_kernel_tests_pass_through_the_generic_launch(file, interpret, min_launches):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TORCHREC_PGAS_TRITON_LAUNCH"] = "generic"
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, os.path.join(TESTS, file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = done.stdout[-8000:] + done.stderr[-3000:]
    assert done.returncode == 0, report
    assert " passed" in done.stdout, report
    launches = int(done.stdout.rsplit("generic launches: ", 1)[1].split()[0])
    assert launches >= min_launches, report
