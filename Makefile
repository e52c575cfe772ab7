# Two dependency sets (see ../shared/DESIGN.md "Where things run"): on a machine with
# NVIDIA GPUs the CUDA set, and every GPU runs a rank; elsewhere the CPU set and two CPU
# ranks on the host transport. torchrec goes in with --no-deps because its metadata asks
# for the CUDA fbgemm-gpu, which must not sit beside fbgemm-gpu-cpu.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
COMMON_DEPS := tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath pytest hypothesis \
	matplotlib numpy triton==3.6.0 nvidia-nvshmem-cu13==3.4.5
CPU_DEPS := torch==2.13.0 fbgemm-gpu-cpu==1.8.0 $(COMMON_DEPS)
CPU_TORCHREC := torchrec==1.8.0
GPU_DEPS := torch==2.11.0 fbgemm-gpu==1.6.0 nvshmem4py-cu13==0.4.1 cuda-core $(COMMON_DEPS)
GPU_TORCHREC := torchrec==1.6.1
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
ifeq ($(GPUS),0)
DEPS := $(CPU_DEPS)
TORCHREC := $(CPU_TORCHREC)
NPROC ?= 2
else
DEPS := $(GPU_DEPS)
TORCHREC := $(GPU_TORCHREC)
NPROC ?= $(GPUS)
endif
DEMO_CHECKPOINT ?= .demo_checkpoint
TORCHRUN := $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)

.PHONY: install test test-gpu bench demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(DEPS)
	$(PY) -m pip install -q --no-deps $(TORCHREC)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test: install
	$(PY) -m pytest -q -m "not slow and not gpu" tests

# The GPU tests (2 GPUs and nvshmem4py), and the benchmark suite on every GPU (or two
# CPU processes): OUT/results.{json,md} and OUT/speedup.png.
test-gpu: install
	$(PY) -m pytest -q -m gpu tests

BENCH_SUITE ?= all
BENCH_OUT ?= benchmark_results
bench: install
	$(TORCHRUN) -m torchrec_pgas.benchmark --suite $(BENCH_SUITE) --out $(BENCH_OUT)

# Train a DLRM with pgas_table_wise on a small file in Criteo's format, then serve its
# checkpoint under pgas_table_wise and TorchRec's table_wise side by side: on every GPU
# with NVSHMEM where there are GPUs, else on two CPU processes with the host transport.
demo: install
	rm -rf $(DEMO_CHECKPOINT) && mkdir -p $(DEMO_CHECKPOINT)
	$(PY) examples/dlrm/make_criteo_sample.py $(DEMO_CHECKPOINT)/sample.tsv --lines 40000
	$(TORCHRUN) examples/dlrm/train.py --sharding pgas_table_wise --steps 300 \
		--data $(DEMO_CHECKPOINT)/sample.tsv --checkpoint $(DEMO_CHECKPOINT)/model
	$(TORCHRUN) examples/dlrm/infer.py --checkpoint $(DEMO_CHECKPOINT)/model \
		--shardings pgas_table_wise,table_wise

clean:
	rm -rf $(VENV) *.egg-info $(DEMO_CHECKPOINT)
