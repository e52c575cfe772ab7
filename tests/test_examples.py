"""The DLRM example end to end on two CPU processes: training under one sharding,
serving its checkpoint under PGAS and TorchRec sharding side by side."""

import os
import subprocess
import sys

import pytest
from dist_utils import EXAMPLE, run_example, torchrun


@pytest.mark.parametrize("trained,served", [("pgas_table_wise", "table_wise"), ("table_wise", "pgas_table_wise")])
def test_train_checkpoint_and_serve_under_the_other_sharding(tmp_path, trained, served):
    ckpt = str(tmp_path / "ckpt")
    out = run_example("train.py", "--sharding", trained, "--steps", "20", "--batch-size", "64", "--checkpoint", ckpt)
    assert f"{trained}: 20 steps on 2 x cpu" in out and "eval AUROC" in out
    out = run_example(
        "infer.py", "--checkpoint", ckpt, "--shardings", f"{trained},{served}", "--batches", "8", "--batch-size", "64"
    )
    assert f"predictions of {trained} and {served}: identical" in out, out


def test_training_resumes_from_its_checkpoint_with_the_optimizer_state(tmp_path):
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    args = ("--sharding", "pgas_table_wise", "--steps", "10", "--batch-size", "64")
    run_example("train.py", *args, "--checkpoint", first)
    out = run_example("train.py", *args, "--resume", first, "--checkpoint", second)
    assert "pgas_table_wise: 10 steps on 2 x cpu" in out
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def momenta(ckpt):
        dcp_to_torch_save(ckpt, ckpt + ".pt")
        state = torch.load(ckpt + ".pt", weights_only=False)
        return {
            name: m
            for k, v in state["optim"]["state"].items()
            if "embedding_bags" in k
            for name, m in v.items()
            if name.endswith("momentum1")
        }

    before, after = momenta(first), momenta(second)
    assert before, "the fused optimizer's state is in the checkpoint"
    # Row-wise Adagrad only adds to its momentum: the resumed run started from the
    # saved one (a fresh start on the same batches would end where the first run did).
    for k, b in before.items():
        assert (after[k] >= b).all() and after[k].sum() > b.sum(), k


def test_train_on_criteo_tsv_learns(tmp_path):
    sample = str(tmp_path / "sample.tsv")
    subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, "make_criteo_sample.py"), sample, "--lines", "16000"], check=True
    )
    out = run_example("train.py", "--data", sample, "--steps", "150", "--batch-size", "64", "--rows", "4000")
    auroc = float(out.split("eval AUROC ")[1].split(",")[0])
    assert auroc > 0.75, out  # the label is a function of one categorical feature


def test_pgas_row_wise_trains_and_serves_next_to_table_wise(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = run_example(
        "train.py", "--sharding", "pgas_row_wise", "--steps", "20", "--batch-size", "64", "--checkpoint", ckpt
    )
    assert "pgas_row_wise: 20 steps on 2 x cpu" in out
    out = run_example(
        "infer.py",
        "--checkpoint",
        ckpt,
        "--shardings",
        "pgas_row_wise,table_wise",
        "--batches",
        "4",
        "--batch-size",
        "64",
    )
    # Row-wise partial sums are added in another order than one table's bag sum.
    assert "predictions of pgas_row_wise and table_wise: " in out, out
    gap = out.split("predictions of pgas_row_wise and table_wise: ")[1].split()
    assert gap[0] == "identical" or float(gap[-1]) < 1e-5, out


def test_torchrec_row_wise_on_cpu_says_to_use_pgas_row_wise(tmp_path):
    done = torchrun(os.path.join(EXAMPLE, "train.py"), "--sharding", "row_wise", "--steps", "2", timeout=300)
    assert done.returncode != 0
    assert "TorchRec's row_wise runs on GPUs only; on CPU use --sharding pgas_row_wise" in done.stdout + done.stderr


def test_serves_the_checkpoint_quantized_under_pgas_table_wise(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_example(
        "train.py", "--sharding", "pgas_table_wise", "--steps", "20", "--batch-size", "64", "--checkpoint", ckpt
    )
    out = run_example(
        "infer.py", "--checkpoint", ckpt, "--shardings", "pgas_table_wise", "--batches", "4", "--batch-size", "64",
        "--quant", "int8",
    )  # fmt: skip
    assert "AUROC float: " in out and "AUROC int8: " in out, out
    gap = float(out.split("predictions of float and int8 (pgas_table_wise) differ by at most ")[1].split()[0])
    assert 0 < gap < 0.02, out  # INT8 rows: one 255th of a row's range per element, before the MLPs


@pytest.mark.parametrize("script", ["train.py", "infer.py"])
def test_cuda_graph_on_cpu_ranks_says_it_needs_gpus(tmp_path, script):
    args = ("--steps", "2") if script == "train.py" else ("--checkpoint", str(tmp_path / "none"))
    done = torchrun(os.path.join(EXAMPLE, script), "--cuda-graph", *args, timeout=300)
    assert done.returncode != 0
    assert "--cuda-graph needs GPU ranks (CUDA graphs); this run's are cpu" in done.stdout + done.stderr
