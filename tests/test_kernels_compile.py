"""Every Triton kernel compiles for sm_90 with the NVSHMEM device bitcode linked.

This runs on CPU-only machines (CI): it proves the kernels compile and link, not what
they do; the GPU tests (tests/test_gpu.py) prove that on the device.
"""

import os

import pytest

triton = pytest.importorskip("triton")
nvidia_nvshmem = pytest.importorskip("nvidia.nvshmem")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from torchrec_pgas.kernels.gather_ids import gather_ids_kernel  # noqa: E402
from torchrec_pgas.kernels.put_signal import put_signal_kernel  # noqa: E402
from torchrec_pgas.kernels.rows_put import rows_put_kernel  # noqa: E402
from torchrec_pgas.kernels.signal_wait import signal_wait_kernel  # noqa: E402


def _bitcode() -> str:
    return os.path.join(list(nvidia_nvshmem.__path__)[0], "lib", "libnvshmem_device.bc")


CASES = {
    "put_signal": (
        put_signal_kernel,
        {"peers_ptr": "*i32", "chunks_ptr": "*i64", "dst_base": "i64", "ready_base": "i64",
         "free_ptr": "*i64", "err_ptr": "*i64", "me": "i32", "step": "i64",
         "free_target": "i64", "timeout_ns": "i64", "NCHUNK": "constexpr"},
        [{"NCHUNK": 4}, {"NCHUNK": 1}, {"NCHUNK": 0}],
    ),
    "signal_wait": (
        signal_wait_kernel,
        {"sig_ptr": "*i64", "peers_ptr": "*i32", "err_ptr": "*i64", "target": "i64",
         "what": "i32", "timeout_ns": "i64"},
        [{}],
    ),
    "rows_put": (
        rows_put_kernel,
        {"src_ptr": "*fp32", "batch_ptr": "*i64", "out_addrs_ptr": "*i64",
         "cnt_addrs_ptr": "*i64", "free_ptr": "*i64", "err_ptr": "*i64",
         "batch_capacity": "i32", "dim": "i32", "pitch": "i32", "col": "i32",
         "free_target": "i64", "timeout_ns": "i64", "BLOCK_B": "constexpr",
         "BLOCK_D": "constexpr"},
        [{"BLOCK_B": 32, "BLOCK_D": 128}],
    ),
    "gather_ids": (
        gather_ids_kernel,
        {"slots_ptr": "*u8", "slot_starts_ptr": "*i64", "counts_ptr": "*i64",
         "offsets_ptr": "*i64", "indices_ptr": "*i64", "weights_ptr": "*fp32",
         "slot_bytes": "i64", "ids_offset": "i64", "weights_offset": "i64",
         "batch_capacity": "i32", "S": "constexpr", "F": "constexpr",
         "HAS_WEIGHTS": "constexpr", "BLOCK": "constexpr"},
        [{"S": 2, "F": 4, "HAS_WEIGHTS": True, "BLOCK": 1024},
         {"S": 3, "F": 1, "HAS_WEIGHTS": False, "BLOCK": 1024}],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_compiles_for_sm90_with_nvshmem(name):
    fn, signature, constexpr_sets = CASES[name]
    for constexprs in constexpr_sets:
        src = ASTSource(fn=fn, signature=signature, constexprs=dict(constexprs))
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options={"extern_libs": (("libnvshmem_device", _bitcode()),), "num_warps": 4},
        )
        assert compiled.asm["cubin"], name
        assert "ptx" in compiled.asm
