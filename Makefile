# Two dependency sets (see ../shared/DESIGN.md "Where things run"): on a machine with
# NVIDIA GPUs the CUDA set, and every GPU runs a rank; elsewhere the CPU set and two CPU
# ranks on the host transport. The pins live in pyproject.toml alone: the extra `gpu` or
# `cpu`, and on CPUs torchrec, installed after it with --no-deps because its metadata asks
# for the CUDA fbgemm-gpu, which must not sit beside fbgemm-gpu-cpu.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
ifeq ($(GPUS),0)
SET := cpu
NPROC ?= 2
else
SET := gpu
NPROC ?= $(GPUS)
endif
# The requirements pyproject.toml's [tool.torchrec-pgas] says go in without dependencies.
NO_DEPS = $$($(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["torchrec-pgas"].get("$(SET)-no-deps", []))')
DEMO_CHECKPOINT ?= .demo_checkpoint
TORCHRUN := $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)

.PHONY: install test lint test-gpu bench demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip "setuptools>=68" wheel
	$(PIP) --no-build-isolation -e ".[$(SET),test,examples]"
	no_deps="$(NO_DEPS)" && if [ -n "$$no_deps" ]; then $(PIP) --no-deps $$no_deps; fi
	touch $@

test: install lint
	$(PY) -m pytest -q -m "not slow and not gpu" tests

# ruff's settings are in pyproject.toml.
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

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
