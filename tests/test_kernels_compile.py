"""Every Triton kernel compiles for sm_90 with the NVSHMEM device bitcode linked.

This runs on CPU-only machines (CI): it proves the kernels compile and link, not what
they do; the GPU tests (tests/test_gpu.py) prove that on the device.
"""

import itertools
import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
nvidia_nvshmem = pytest.importorskip("nvidia.nvshmem")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from torchrec_pgas.kernels import (
    grads_put,  # noqa: E402
    lookup_put,  # noqa: E402
    nvshmem_device,  # noqa: E402
    output_take,  # noqa: E402
    put_signal,  # noqa: E402
    row_update,  # noqa: E402
    rows_put,  # noqa: E402
    run_groups,  # noqa: E402
    run_update,  # noqa: E402
    update_keys,  # noqa: E402
)
from torchrec_pgas.kernels.bag_offsets import bag_offsets_kernel  # noqa: E402
from torchrec_pgas.kernels.gather_ids import gather_ids_kernel  # noqa: E402
from torchrec_pgas.kernels.grads_put import grads_put_kernel  # noqa: E402
from torchrec_pgas.kernels.ids_check import ids_check_kernel  # noqa: E402
from torchrec_pgas.kernels.ids_header import ids_header_kernel  # noqa: E402
from torchrec_pgas.kernels.local_finish import local_finish_kernel  # noqa: E402
from torchrec_pgas.kernels.lookup_put import lookup_put_kernel  # noqa: E402
from torchrec_pgas.kernels.output_take import output_take_kernel  # noqa: E402
from torchrec_pgas.kernels.put_signal import put_signal_kernel  # noqa: E402
from torchrec_pgas.kernels.row_buckets import row_buckets_kernel  # noqa: E402
from torchrec_pgas.kernels.row_update import row_update_kernel  # noqa: E402
from torchrec_pgas.kernels.rows_put import rows_put_kernel  # noqa: E402
from torchrec_pgas.kernels.run_groups import run_groups_kernel  # noqa: E402
from torchrec_pgas.kernels.run_update import run_update_kernel  # noqa: E402
from torchrec_pgas.kernels.signal_wait import signal_wait_kernel  # noqa: E402
from torchrec_pgas.kernels.sort_order import TABLE_WORDS, sort_order_kernel  # noqa: E402
from torchrec_pgas.kernels.step_verdict import step_verdict_kernel  # noqa: E402
from torchrec_pgas.kernels.transpose_bags import transpose_bags_kernel  # noqa: E402
from torchrec_pgas.kernels.transposed_ids import transposed_ids_kernel  # noqa: E402
from torchrec_pgas.kernels.update_keys import FEATURE_WORDS, update_keys_kernel  # noqa: E402


def _bitcode() -> str:
    return os.path.join(list(nvidia_nvshmem.__path__)[0], "lib", "libnvshmem_device.bc")


CASES = {
    "put_signal": (
        put_signal_kernel,
        {
            "peers_ptr": "*i32",
            "chunks_ptr": "*i64",
            "dst_base": "i64",
            "ready_base": "i64",
            "free_ptr": "*i64",
            "err_ptr": "*i64",
            "step_ptr": "*i64",
            "done_ptr": "*i64",
            "me": "i64",
            "num_rows": "i64",
            "self_row": "i64",
            "step_add": "i64",
            "wait_depth": "i64",
            "timeout_ns": "i64",
            "NCHUNK": "constexpr",
            "PROGRAMS": "constexpr",
            "SPLIT": "constexpr",
            "ALIGN": "constexpr",
            "COPY": "constexpr",
        },
        [
            {"NCHUNK": n, "PROGRAMS": 32 if n else 1, "SPLIT": split, "ALIGN": 16, "COPY": put_signal.COPY}
            for n, split in ((4, 1), (13, 1), (1, 1), (0, 1), (4, put_signal.SELF_SPLIT), (1, put_signal.SELF_SPLIT))
        ],
    ),
    "signal_wait": (
        signal_wait_kernel,
        {
            "sig_ptr": "*i64",
            "peers_ptr": "*i32",
            "err_ptr": "*i64",
            "step_ptr": "*i64",
            "num_peers": "i32",
            "step_add": "i64",
            "per_step": "i64",
            "what": "i32",
            "timeout_ns": "i64",
            "TICK": "constexpr",
        },
        [{"TICK": t} for t in (True, False)],
    ),
    "rows_put": (
        rows_put_kernel,
        {
            "src_ptr": "*fp32",
            "batch_ptr": "*i64",
            "batch_stride": "i32",
            "own_ptr": "*fp32",
            "me": "i64",
            "out_addrs_ptr": "*i64",
            "cnt_addrs_ptr": "*i64",
            "free_ptr": "*i64",
            "err_ptr": "*i64",
            "out_step_ptr": "*i64",
            "batch_capacity": "i32",
            "dim": "i32",
            "pitch": "i32",
            "own_pitch": "i32",
            "col": "i32",
            "timeout_ns": "i64",
            "BLOCK_B": "constexpr",
            "BLOCK_D": "constexpr",
            "ALIGN": "constexpr",
            "DEPTH": "constexpr",
            "PUT_PATH": "constexpr",
        },
        [{"BLOCK_B": 32, "BLOCK_D": 128, "ALIGN": 16, "DEPTH": 2, "PUT_PATH": p} for p in (False, True)],
    ),
    "grads_put": (
        grads_put_kernel,
        {
            "grad_ptr": "*fp32",
            "dests_ptr": "*i64",
            "free_ptr": "*i64",
            "err_ptr": "*i64",
            "step_ptr": "*i64",
            "batch": "i64",
            "pitch": "i32",
            "generation_bytes": "i64",
            "scale": "fp32",
            "step_add": "i64",
            "timeout_ns": "i64",
            "BLOCK_B": "constexpr",
            "BLOCK_D": "constexpr",
            "ALIGN": "constexpr",
            "DEST_WORDS": "constexpr",
            "DEPTH": "constexpr",
            "PUT_PATH": "constexpr",
        },
        [
            {"BLOCK_B": 32, "BLOCK_D": 128, "ALIGN": 16, "DEST_WORDS": 5, "DEPTH": 1, "PUT_PATH": False},
            {
                "BLOCK_B": 32,
                "BLOCK_D": 128,
                "ALIGN": 16,
                "DEST_WORDS": grads_put.PUT_DEST_WORDS,
                "DEPTH": 2,
                "PUT_PATH": True,
            },
        ],
    ),
    "output_take": (
        output_take_kernel,
        {
            "slots_ptr": "*fp32",
            "out_ptr": "*fp32",
            "counts_ptr": "*i64",
            "owners_ptr": "*i32",
            "out_free_ptr": "*i64",
            "ids_free_ptr": "*i64",
            "done_ptr": "*i64",
            "err_ptr": "*i64",
            "record_ptr": "*i64",
            "clock_ptr": "*i64",
            "batch": "i64",
            "rows": "i64",
            "pitch": "i32",
            "out_pitch": "i32",
            "num_owners": "i64",
            "num_sources": "i64",
            "expect": "i64",
            "timeout_ns": "i64",
            "at": "i64",
            "ring_addr": "i64",
            "own_block": "i64",
            "own_begin4": "i64",
            "own_end4": "i64",
            "DEPTH": "constexpr",
            "BLOCKS": "constexpr",
            "BLOCK_B": "constexpr",
            "BLOCK_D": "constexpr",
            "RELEASE_IDS": "constexpr",
            "RING": "constexpr",
            "PUT_PATH": "constexpr",
        },
        [
            {"DEPTH": 2, "BLOCKS": b, "BLOCK_B": 32, "BLOCK_D": 128, "RELEASE_IDS": r, "RING": 64, "PUT_PATH": p}
            for b in (1, 2)
            for p in (False, True)
            for r in (False, True)
        ],
    ),
    "ids_check": (
        ids_check_kernel,
        {
            "values_ptr": "*i64",
            "offsets_ptr": "*i64",
            "lengths_ptr": "*i64",
            "narrowed_ptr": "*i32",
            "num_rows_ptr": "*i64",
            "verdict_ptr": "*i64",
            "ids_out_ptr": "*i32",
            "offsets_out_ptr": "*i32",
            "n_ids": "i64",
            "n_lengths": "i32",
            "batch": "i32",
            "num_features": "i32",
            "NONE": "constexpr",
            "NARROW": "constexpr",
            "SANITIZE": "constexpr",
            "BLOCK": "constexpr",
            "FEATURES": "constexpr",
        },
        [
            {"NONE": 2**62, "NARROW": n, "SANITIZE": s, "BLOCK": 1024, "FEATURES": f}
            for n, s, f in ((True, False, 1), (False, True, 32), (False, False, 8))
        ],
    ),
    "local_finish": (
        local_finish_kernel,
        {
            "out_ptr": "*fp16",
            "verdict_ptr": "*i64",
            "values_ptr": "*i32",
            "offsets_ptr": "*i64",
            "num_rows_ptr": "*i64",
            "clock_ptr": "*i64",
            "ring_addr": "i64",
            "n_out": "i64",
            "n_ids": "i64",
            "batch": "i64",
            "num_features": "i64",
            "host_status": "i64",
            "host_d0": "i64",
            "host_d1": "i64",
            "host_d2": "i64",
            "has_weights": "i64",
            "NONE": "constexpr",
            "RING": "constexpr",
            "WORDS": "constexpr",
            "BLOCK": "constexpr",
        },
        [{"NONE": 2**62, "RING": 64, "WORDS": 8, "BLOCK": 1024}],
    ),
    "ids_header": (
        ids_header_kernel,
        {
            "verdict_ptr": "*i64",
            "values_ptr": "*i64",
            "offsets_ptr": "*i32",
            "check_values_ptr": "*i64",
            "check_offsets_ptr": "*i64",
            "num_rows_ptr": "*i64",
            "runs_ptr": "*i64",
            "headers_ptr": "*i64",
            "chunks_ptr": "*i64",
            "step_ptr": "*i64",
            "batch": "i32",
            "n_ids": "i64",
            "num_features": "i32",
            "num_check_features": "i32",
            "has_weights": "i32",
            "host_status": "i32",
            "host_d0": "i64",
            "host_d1": "i64",
            "host_d2": "i64",
            "batch_capacity": "i32",
            "ids_capacity": "i64",
            "my_slot": "i64",
            "generation_bytes": "i64",
            "lengths_offset": "i64",
            "ids_offset": "i64",
            "weights_offset": "i64",
            "lengths_addr": "i64",
            "values_addr": "i64",
            "weights_addr": "i64",
            "headers_addr": "i64",
            "W": "constexpr",
            "BLOCK_W": "constexpr",
            "R": "constexpr",
            "WORDS": "constexpr",
            "NONE": "constexpr",
        },
        [
            {"W": 3, "BLOCK_W": 4, "R": 1, "WORDS": 8, "NONE": 2**62, "DEPTH": 2},
            {"W": 2, "BLOCK_W": 2, "R": 4, "WORDS": 8, "NONE": 2**62, "DEPTH": 2},
        ],
    ),
    "bag_offsets": (
        bag_offsets_kernel,
        {
            "ids_ptr": "*u8",
            "offsets_ptr": "*i64",
            "record_ptr": "*i64",
            "ready_ptr": "*i64",
            "err_ptr": "*i64",
            "scan_ptr": "*i64",
            "step_ptr": "*i64",
            "num_features": "i32",
            "num_sources": "i32",
            "batch_capacity": "i32",
            "slot_bytes": "i64",
            "lengths_offset": "i32",
            "per_step": "i64",
            "timeout_ns": "i64",
            "WAIT": "constexpr",
            "WORDS": "constexpr",
            "BLOCK": "constexpr",
            "LOOK": "constexpr",
            "DEPTH": "constexpr",
        },
        [{"WAIT": w, "WORDS": 8, "BLOCK": 1024, "LOOK": 256, "DEPTH": 2} for w in (True, False)],
    ),
    "row_buckets": (
        row_buckets_kernel,
        {
            "values_ptr": "*i64",
            "offsets_ptr": "*i64",
            "weights_ptr": "*fp32",
            "block_sizes_ptr": "*i64",
            "lengths_out_ptr": "*i32",
            "offsets_out_ptr": "*i32",
            "values_out_ptr": "*i64",
            "weights_out_ptr": "*fp32",
            "num_values": "i64",
            "num_bags": "i32",
            "batch": "i32",
            "world": "i32",
            "COUNT": "constexpr",
            "HAS_WEIGHTS": "constexpr",
            "BLOCK": "constexpr",
            "W_PAD": "constexpr",
        },
        [{"COUNT": c, "HAS_WEIGHTS": w, "BLOCK": 128, "W_PAD": 8} for c in (True, False) for w in (True, False)],
    ),
    "gather_ids": (
        gather_ids_kernel,
        {
            "ids_ptr": "*u8",
            "step_ptr": "*i64",
            "offsets_ptr": "*i64",
            "indices_ptr": "*i64",
            "weights_ptr": "*fp32",
            "first_feature": "i32",
            "num_sources": "i32",
            "batch_capacity": "i32",
            "slot_bytes": "i64",
            "ids_offset": "i64",
            "weights_offset": "i64",
            "HAS_WEIGHTS": "constexpr",
            "SPLIT": "constexpr",
            "BLOCK": "constexpr",
        },
        [{"HAS_WEIGHTS": w, "SPLIT": 32, "BLOCK": 1024, "DEPTH": 2} for w in (True, False)],
    ),
    "update_keys": (
        update_keys_kernel,
        {
            "offsets_ptr": "*i64",
            "indices_ptr": "*i64",
            "weights_ptr": "*fp32",
            "features_ptr": "*i64",
            "keys_ptr": "*i32",
            "src_ptr": "*i64",
            "scale_ptr": "*fp32",
        },
        [
            {
                "FEATURE_WORDS": FEATURE_WORDS,
                "SCALED": scaled,
                "WEIGHTED": w,
                "PACKED": packed,
                "BLOCK_B": 32,
                "BLOCK_J": 32,
            }
            for scaled, w in ((False, False), (True, False), (True, True))
            for packed in (False, True)
        ],
    ),
    "sort_order": (
        sort_order_kernel,
        {
            "keys_ptr": "*i32",
            "order_ptr": "*i32",
            "offsets_ptr": "*i64",
            "src_ptr": "*i64",
            "scale_ptr": "*fp32",
            "tables_ptr": "*i64",
            "keys_out_ptr": "*i32",
            "src_out_ptr": "*i64",
            "scale_out_ptr": "*fp32",
            "table_out_ptr": "*i32",
        },
        [
            {
                "SENTINEL": 2**31 - 1,
                "TABLE_WORDS": TABLE_WORDS,
                "SCALED": scaled,
                "PACKED": packed,
                "BLOCK": 1024,
            }
            for scaled in (False, True)
            for packed in (False, True)
        ],
    ),
    "transpose_bags": (
        transpose_bags_kernel,
        {"offsets_ptr": "*i64", "indices_ptr": "*i32", "offsets_out_ptr": "*i32"},
        [{"BLOCK": 1024}],
    ),
    "transposed_ids": (
        transposed_ids_kernel,
        {
            "keys_ptr": "*i32",
            "infos_ptr": "*i32",
            "offsets_ptr": "*i32",
            "features_ptr": "*i64",
            "tables_ptr": "*i64",
            "keys_out_ptr": "*i32",
            "src_out_ptr": "*i64",
            "scale_out_ptr": "*fp32",
            "table_out_ptr": "*i32",
        },
        [
            {
                "B_BITS": 17,
                "SENTINEL": 2**31 - 1,
                "FEATURE_WORDS": FEATURE_WORDS,
                "TABLE_WORDS": TABLE_WORDS,
                "SCALED": scaled,
                "BLOCK": 1024,
            }
            for scaled in (False, True)
        ],
    ),
    "step_verdict": (
        step_verdict_kernel,
        {"record_ptr": "*i64", "err_ptr": "*i64", "verdict_ptr": "*i64"},
        [{"HEADER_WORDS": 8, "OK": 0}],
    ),
    "row_update": (
        row_update_kernel,
        {
            "keys_ptr": "*i32",
            "src_ptr": "*i64",
            "scale_ptr": "*fp32",
            "table_index_ptr": "*i32",
            "tables_ptr": "*i64",
            "grad_ptr": "*fp32",
            "weights_ptr": "*fp32",
            "state_ptr": "*fp32",
            "partial_ptr": "*fp32",
            "verdict_ptr": "*i64",
            "hyper_ptr": "*fp32",
        },
        [
            {
                "OPTIM": optim,
                "SCALED": scaled,
                "SENTINEL": 2**31 - 1,
                "TABLE_WORDS": TABLE_WORDS,
                "BLOCK": 32,
                "ROWS": rows,
                "BLOCK_D": block_d,
                "PARTIAL_PITCH": block_d,
                "GRAD_ALIGNED": scaled,
                "RESTRIDE": restride,
            }
            for optim in (0, 1)
            for scaled in (False, True)
            for rows, block_d in ((8, 128), (1, 1024))
            for restride in (False, True)
        ],
    ),
    "run_update": (
        run_update_kernel,
        {
            "keys_ptr": "*i64",
            "table_index_ptr": "*i32",
            "tables_ptr": "*i64",
            "weights_ptr": "*fp32",
            "state_ptr": "*fp32",
            "partial_ptr": "*fp32",
            "sums_ptr": "*fp32",
            "verdict_ptr": "*i64",
            "hyper_ptr": "*fp32",
        },
        [
            {
                "OPTIM": optim,
                "SENTINEL": 2**63 - 1,
                "TABLE_WORDS": TABLE_WORDS,
                "BLOCK": 32,
                "BLOCKS": run_update.BLOCKS,
                "GROUP": run_groups.GROUP,
                "CHUNK": 8,
                "BLOCK_D": 128,
                "PARTIAL_PITCH": 128,
            }
            for optim in (0, 1)
        ],
    ),
    "run_groups": (
        run_groups_kernel,
        {"keys_ptr": "*i32", "partial_ptr": "*fp32", "sums_ptr": "*fp32"},
        [
            {
                "SENTINEL": 2**31 - 1,
                "BLOCK": 64,
                "GROUP": run_groups.GROUP,
                "CHUNK": chunk,
                "BLOCK_D": block_d,
                "PITCH": pitch,
            }
            for chunk, block_d, pitch in ((4, 128, 128), (1, 1024, 1008))
        ],
    ),
}
# Groups of more rows than the int32 sentinel key by int64 (sorted by ``torch.sort``'s
# int64 order or FBGEMM's int32 one).
CASES["update_keys_int64_keys"] = (
    update_keys_kernel,
    {**CASES["update_keys"][1], "keys_ptr": "*i64"},
    [c for c in CASES["update_keys"][2] if c["SCALED"] and c["WEIGHTED"] and not c["PACKED"]],
)
# The fused update's int32 copy of the ids (``FusedUpdate.ids_dtype``).
CASES["update_keys_int32_ids"] = (
    update_keys_kernel,
    {**CASES["update_keys"][1], "indices_ptr": "*i32"},
    [c for c in CASES["update_keys"][2] if c["SCALED"] and not c["WEIGHTED"]],
)
CASES["gather_ids_int32_ids"] = (
    gather_ids_kernel,
    {**CASES["gather_ids"][1], "indices_ptr": "*i32"},
    [c for c in CASES["gather_ids"][2] if not c["HAS_WEIGHTS"]],
)
for _order in ("i32", "i64"):
    CASES[f"sort_order_int64_keys_{_order}_order"] = (
        sort_order_kernel,
        {**CASES["sort_order"][1], "keys_ptr": "*i64", "keys_out_ptr": "*i64", "order_ptr": f"*{_order}"},
        [{**c, "SENTINEL": 2**63 - 1} for c in CASES["sort_order"][2] if c["SCALED"] and not c["PACKED"]],
    )
for _table, _out in (("fp32", "fp32"), ("fp16", "fp32"), ("bf16", "bf16")):
    CASES[f"lookup_put_{_table}_to_{_out}"] = (
        lookup_put_kernel,
        {
            "mailbox_ptr": "*u8",
            "ids_step_ptr": "*i64",
            "out_step_ptr": "*i64",
            "offsets_ptr": "*i64",
            "features_ptr": "*i64",
            "table_ptr": f"*{_table}",
            "own_ptr": f"*{_out}",
            "out_addrs_ptr": "*i64",
            "cnt_addrs_ptr": "*i64",
            "done_ptr": "*i64",
            "free_ptr": "*i64",
            "err_ptr": "*i64",
            "batch_capacity": "i32",
            "slot_bytes": "i64",
            "ids_offset": "i64",
            "weights_offset": "i64",
            "pitch": "i32",
            "done_target": "i64",
            "timeout_ns": "i64",
            "me": "i64",
            "DEPTH": "constexpr",
            "HAS_WEIGHTS": "constexpr",
            "ROW_ALIGN": "constexpr",
            "OUT_ALIGN": "constexpr",
            "COUNT_B": "constexpr",
            "BLOCK_B": "constexpr",
            "BLOCK_D": "constexpr",
            "ROWS": "constexpr",
            "FEATURES": "constexpr",
            "PUT_PATH": "constexpr",
        },
        [
            {
                "DEPTH": 2,
                "HAS_WEIGHTS": w,
                "ROW_ALIGN": 16,
                "OUT_ALIGN": 16,
                "COUNT_B": 32,
                "BLOCK_B": lookup_put.BLOCK_B,
                "BLOCK_D": lookup_put.BLOCK_D,
                "ROWS": lookup_put.ROWS,
                "FEATURES": n,
                "PUT_PATH": p,
            }
            for w, n in ((True, 1), (False, 32))
            for p in (False, True)
        ],
    )


def _signature(fn, given):
    """``given``, with the types the kernel declares (what every launch compiles)."""
    return {**given, **{p.name: p.annotation_type for p in fn.params if p.annotation_type and not p.is_constexpr}}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_compiles_for_sm90_with_nvshmem(name):
    fn, signature, constexpr_sets = CASES[name]
    for constexprs in constexpr_sets:
        src = ASTSource(fn=fn, signature=_signature(fn, signature), constexprs=dict(constexprs))
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options={"extern_libs": (("libnvshmem_device", _bitcode()),), "num_warps": 4},
        )
        assert compiled.asm["cubin"], name
        assert "ptx" in compiled.asm


@pytest.mark.parametrize("name", sorted(CASES))
def test_unspecialized_ints_are_typed(name):
    """``Launcher`` keys a launch without Triton's binder only on parameters whose
    specialization can change: an int Triton does not specialize must say its type."""
    fn = CASES[name][0]
    untyped = [p.name for p in fn.params if p.do_not_specialize and p.annotation_type != "i64"]
    assert not untyped, untyped


def _ptx(name, constexprs, num_warps, attrs=None):
    fn, signature, _ = CASES[name]
    src = ASTSource(fn=fn, signature=_signature(fn, signature), constexprs=constexprs, attrs=attrs or {})
    options = {"extern_libs": (("libnvshmem_device", _bitcode()),), "num_warps": num_warps}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _variant(name, **chosen):
    """The one constexpr set of ``CASES[name]`` with the ``chosen`` values."""
    (found,) = [c for c in CASES[name][2] if all(c[k] == v for k, v in chosen.items())]
    return found


def test_put_signal_copies_its_own_share_in_words_and_releases_the_count_after_it():
    """A put to the rank itself is a plain copy: 16-byte loads and stores where the
    addresses and sizes allow, and one add to the rank's own signal with release
    semantics at system scope (what the waits acquire), after the block's barrier and
    after every chunk's stores; the copy keeps the kernel's registers at most 64 (every
    program of the launch, the peers' too, is compiled with the most any path needs)."""
    for nchunk in (1, 4, 13):
        ptx = _ptx("put_signal", _variant("put_signal", NCHUNK=nchunk, SPLIT=1), put_signal.NUM_WARPS)
        stores = [m.start() for m in re.finditer(r"st\.global\.v2\.b64", ptx)]
        assert ptx.count("ld.global.v2.b64") >= nchunk and len(stores) >= nchunk
        assert ptx.count("atom.global.sys.release.add.u64") == 1
        release = ptx.index("atom.global.sys.release.add.u64")
        barrier = ptx.rfind("bar.sync", 0, release)
        assert barrier > max(stores) and "st.global" not in ptx[barrier:release]
        assert _registers(ptx) <= 64
    ptx = _ptx("put_signal", _variant("put_signal", NCHUNK=0), put_signal.NUM_WARPS)
    assert "v2.b64" not in ptx and "atom.global.sys.release" not in ptx, "a pure release copies nothing"


def test_put_signal_split_self_copy_counts_each_share_in_once_after_its_programs():
    """With the self row split among ``SELF_SPLIT`` programs per share, a program ticks
    its share's ``done`` word (acquire-release at GPU scope) after the block's barrier
    and its last stores, and only the last adds the share's one to the signal (release
    at system scope), after that tick: one count per share, every part's copy
    published by it."""
    for nchunk in (1, 4):
        ptx = _ptx(
            "put_signal", _variant("put_signal", NCHUNK=nchunk, SPLIT=put_signal.SELF_SPLIT), put_signal.NUM_WARPS
        )
        stores = [m.start() for m in re.finditer(r"st\.global\.v2\.b64", ptx)]
        assert ptx.count("atom.global.sys.release.add.u64") == 1
        ticks = [m.start() for m in re.finditer(r"atom\.global\.gpu\.acq_rel\.add", ptx)]
        assert len(ticks) == 1, "one tick of the share's done word"
        barrier = ptx.rfind("bar.sync", 0, ticks[0])
        assert barrier > max(stores) and "st.global" not in ptx[barrier : ticks[0]]
        release = ptx.index("atom.global.sys.release.add.u64")
        assert ticks[0] < release
        # Only the last of the share's programs counts in (the tick returned SPLIT - 1)
        # and leaves the word at zero for the next launch.
        between = ptx[ticks[0] : release]
        assert re.search(rf"setp\.ne\.b64\s+(%p\d+), %rd\d+, {put_signal.SELF_SPLIT - 1};", between)
        assert "atom.global.gpu.relaxed.exch.b64" in between
        (skip,) = re.findall(r"@%p\d+ bra\s+(\$L__BB\d+_\d+);", between)
        assert ptx.index(f"{skip}:") > release, "the other programs branch past the count"
        assert _registers(ptx) <= 64


def _registers(ptx: str) -> int:
    """The registers per thread that ptxas (Triton's own) gives ``ptx`` for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return max(int(n) for n in re.findall(r"Used (\d+) registers", done.stderr))


def test_pooled_rows_move_four_elements_at_once():
    """``lookup_put`` reads table rows and stores pooled rows 4 fp32 at a time (16-byte
    accesses, as FBGEMM's forward does; moving one at a time, it took 0.29 ms at R1 where
    FBGEMM's forward took 0.18 ms). ``rows_put``, ``grads_put`` and ``output_take`` do too
    once Triton has specialized their sizes as multiples of 16."""
    unweighted = _variant("lookup_put_fp32_to_fp32", HAS_WEIGHTS=False, PUT_PATH=False)
    ptx = _ptx("lookup_put_fp32_to_fp32", unweighted, lookup_put.NUM_WARPS)
    assert ptx.count("ld.global.v4.b32") >= lookup_put.ROWS and "st.global.v4.b32" in ptx
    assert "ld.global.b32" not in ptx, "every table load is a vector load"
    sixteen = [["tt.divisibility", 16]]
    names = list(CASES["rows_put"][1])
    # (The own rows' stride is not specialized: a joined output's need not be a multiple of 16.)
    attrs = {(names.index(a),): sixteen for a in ("src_ptr", "dim", "pitch", "col")}
    ptx = _ptx("rows_put", _variant("rows_put", PUT_PATH=False), rows_put.NUM_WARPS, attrs)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "ld.global.b32" not in ptx and "st.global.b32" not in ptx
    # ``grads_put`` on the way back, its columns and dims read from its table.
    names = list(CASES["grads_put"][1])
    attrs = {(names.index(a),): sixteen for a in ("grad_ptr", "pitch")}
    ptx = _ptx("grads_put", _variant("grads_put", PUT_PATH=False), grads_put.NUM_WARPS, attrs)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "ld.global.b32" not in ptx and "st.global.b32" not in ptx
    # ``output_take``, which copies (sums) the requester's output out of its slot.
    names = list(CASES["output_take"][1])
    attrs = {(names.index(a),): sixteen for a in ("slots_ptr", "out_ptr", "pitch")}
    ptx = _ptx(
        "output_take", _variant("output_take", BLOCKS=2, PUT_PATH=False, RELEASE_IDS=True), output_take.NUM_WARPS, attrs
    )
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert ptx.count("ld.global.b32") == 1 and "st.global.b32" not in ptx, "one scalar load: an owner's rank"


def test_fused_update_moves_rows_four_elements_at_once():
    """``row_update`` and ``run_update`` read and write table rows 4 fp32 at a time
    (FBGEMM's rows are multiples of 4 elements), and ``row_update`` the gradient's rows
    too where its pitch allows (``GRAD_ALIGNED``): a scalar access per element held twice
    the registers per row and, with them, half the rows in flight."""
    sixteen = [["tt.divisibility", 16]]
    names = list(CASES["row_update"][1])
    attrs = {(names.index(a),): sixteen for a in CASES["row_update"][1]}
    # Re-strided gradient rows (a column slice of a wider gradient) are read so too.
    for aligned, restride in itertools.product((True, False), (False, True)):
        chosen = _variant("row_update", OPTIM=0, SCALED=aligned, ROWS=8, GRAD_ALIGNED=aligned, RESTRIDE=restride)
        ptx = _ptx("row_update", chosen, row_update.NUM_WARPS, attrs)
        # Per row of the block (8 rows of 128 over 32 lanes): its weights, and with
        # GRAD_ALIGNED its gradient, as one 16-byte access per lane.
        assert ptx.count("ld.global.v4.b32") >= (16 if aligned else 8), (aligned, restride)
        assert ptx.count("st.global.v4.b32") >= 8 and "st.global.b32" not in ptx, (aligned, restride)
    names = list(CASES["run_update"][1])
    attrs = {(names.index(a),): sixteen for a in CASES["run_update"][1]}
    ptx = _ptx("run_update", _variant("run_update", OPTIM=0), run_update.NUM_WARPS, attrs)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx


def test_update_keys_tiles_keep_many_programs_per_multiprocessor():
    """``update_keys`` at every tile shape its launch picks (one to hundreds of ids per
    bag), keyed for every gradient scale: at most 64 registers per thread, so that at
    least four of its programs share a multiprocessor. The kernel is a chain of
    dependent loads whose latency only other programs hide; at 1024 positions on 4 warps
    it took 176 to 255 registers (two programs per multiprocessor) and a quarter of the
    DRAM bandwidth."""
    shapes = sorted({update_keys.tile_shape(ids, 1000) for ids in (1000, 3000, 7000, 12000, 20000, 100000)})
    assert len(shapes) == 4, shapes
    for (block_b, block_j), chosen in itertools.product(shapes, CASES["update_keys"][2]):
        ptx = _ptx("update_keys", {**chosen, "BLOCK_B": block_b, "BLOCK_J": block_j}, update_keys.NUM_WARPS)
        assert _registers(ptx) <= 64, (block_b, block_j, chosen)


#: The kernels that store through peer mappings, each with a ``PUT_PATH`` variant for
#: peers without one, and what that variant must call: row puts, completed (quiet) before
#: the count, the count or release as a block's put-with-signal. NVSHMEM's API functions
#: are inlined; these are the transfer functions they call (C++ names, mangled).
_PUT, _QUIET, _SIGNAL = "nvshmemi_transfer_rma_nbi", "nvshmemi_transfer_quiet", "nvshmemi_transfer_put_signal"
PUT_PATH_CALLS = {
    "rows_put": ({}, (_PUT, _QUIET, _SIGNAL)),
    "grads_put": ({}, (_PUT, _QUIET, _SIGNAL)),
    "lookup_put_bf16_to_bf16": ({"HAS_WEIGHTS": True}, (_PUT, _QUIET, _SIGNAL)),
    "output_take": ({"BLOCKS": 2, "RELEASE_IDS": True}, (_SIGNAL,)),
}


@pytest.mark.parametrize("name", sorted(PUT_PATH_CALLS))
def test_put_path_is_compiled_in_only_when_asked(name, tmp_path):
    """Without ``PUT_PATH`` a kernel is its peer-mapping code alone: no NVSHMEM in it (the
    PTX was also compared with the kernels' before the put path existed: identical but
    for line numbers); with it, the kernel puts, completes and signals, and only that
    variant is the one ``needs_module_init`` sends to ``nvshmem.core.module_init``."""
    fn = CASES[name][0]
    chosen, calls = PUT_PATH_CALLS[name]
    off = _ptx(name, _variant(name, **chosen, PUT_PATH=False), 4)
    on = _ptx(name, _variant(name, **chosen, PUT_PATH=True), 4)
    assert "nvshmem" not in off
    for call in calls:
        assert re.search(rf"call\.uni\s+\w*{call}\w*,", on), call
    kernel = fn.fn.__name__
    assert kernel in nvshmem_device.KERNELS_WITH_PUT_PATH
    for ptx, needed in ((off, False), (on, True)):
        (tmp_path / f"{kernel}.ptx").write_text(ptx)
        group = {f"{kernel}.ptx": str(tmp_path / f"{kernel}.ptx"), f"{kernel}.json": str(tmp_path / "unused.json")}
        assert nvshmem_device.needs_module_init(kernel, group) is needed
    assert nvshmem_device.needs_module_init("put_signal_kernel", {}) is True
    assert nvshmem_device.needs_module_init("bag_offsets_kernel", {}) is False


@pytest.mark.parametrize("launch", ["rows_put", "lookup_put", "grads_put", "output_take"])
def test_put_path_launch_refuses_a_table_of_the_wrong_shape(launch):
    """The put path reads its tables by position: a table of another shape (such as the
    peer-mapping row alone) is refused before any launch, naming the argument."""
    import torch

    from torchrec_pgas.kernels.ids_slot import IdsSlotLayout
    from torchrec_pgas.kernels.step_clock import StepRef

    i64 = torch.zeros(4, dtype=torch.int64)
    f32 = torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"(out_addrs|dests|ids_free|out_free): the put path takes a contiguous int64"):
        if launch == "rows_put":
            rows_put.rows_put(f32, i64, f32, 0, i64.view(1, 4), i64, i64, i64, i64[:1], 2, 4, 0, 1, put_path=True)
        elif launch == "lookup_put":
            layout = IdsSlotLayout.__new__(IdsSlotLayout)
            lookup_put.lookup_put(
                i64,
                i64[:1],
                i64[:1],
                i64,
                torch.zeros(1, 4, dtype=torch.int64),
                f32,
                f32,
                0,
                i64.view(1, 4),
                i64,
                i64,
                i64,
                i64,
                layout,
                4,
                False,
                1,
                put_path=True,
            )
        elif launch == "grads_put":
            step = StepRef(i64[:1], 1)
            grads_put.grads_put(
                f32, torch.zeros(2, 5, dtype=torch.int64), i64, i64, 8, step, 1, 0, 1.0, 1, put_path=True
            )
        else:
            output_take.output_take(
                torch.zeros(2, 1, 8, 4),
                f32,
                i64,
                i64.to(torch.int32),
                i64,
                i64,
                i64,
                i64,
                i64,
                0,
                i64,
                1,
                False,
                torch.zeros(2, output_take.RECORD_WORDS + 1, dtype=torch.int64),
                1,
                (0, 0, 0),
                put_path=True,
            )


@pytest.mark.parametrize(
    "own",
    ["1-D", "other pitch", "columns apart", "rows overlap", "unaligned slice", "other dtype"],
)
def test_an_output_the_puts_cannot_store_own_rows_into_is_refused(own):
    """``rows_put``, ``lookup_put`` and ``output_take`` store a rank's own rows into its
    output as rows of the pitch in the rows' dtype, their elements contiguous, 4-element
    aligned (the kernels move 4 at once): a contiguous output or a column slice of the
    module's joined one. Anything else is refused before a launch, naming ``own``."""
    import torch

    bad = {
        "1-D": torch.zeros(40),
        "other pitch": torch.zeros(5, 12),
        "columns apart": torch.zeros(8, 5).t(),
        "rows overlap": torch.zeros(40).as_strided((5, 8), (4, 1)),
        "unaligned slice": torch.zeros(5, 18)[:, 2:10],
        "other dtype": torch.zeros(5, 8, dtype=torch.float16),
    }[own]
    for good in (torch.zeros(5, 8), torch.zeros(5, 20)[:, 4:12], torch.zeros(0, 8), torch.zeros(2, 12)[:, 4:12]):
        rows_put.check_own(good, 8, torch.float32)
    with pytest.raises(ValueError, match="own: torch.float32 rows of 8 contiguous elements"):
        rows_put.check_own(bad, 8, torch.float32)
    i64 = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="own: torch.float32 rows of 8"):
        rows_put.rows_put(torch.zeros(8, 8), i64, bad, 0, i64.view(1, 4), i64, i64, i64, i64[:1], 2, 8, 0, 1)
