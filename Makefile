# CPU dependency set (see ../shared/DESIGN.md "Where things run"). torchrec goes in with
# --no-deps because its metadata asks for the CUDA fbgemm-gpu, which must not sit beside
# fbgemm-gpu-cpu.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CPU_DEPS := torch==2.13.0 fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics==1.0.3 tqdm \
	pyre-extensions iopath pytest hypothesis matplotlib numpy triton==3.6.0 nvidia-nvshmem-cu13==3.4.5
NPROC ?= 2
DEMO_CHECKPOINT ?= .demo_checkpoint
TORCHRUN := $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)

.PHONY: install test demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CPU_DEPS)
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test: install
	$(PY) -m pytest -q -m "not slow and not gpu" tests

# Train a DLRM with pgas_table_wise on a small file in Criteo's format, then serve its
# checkpoint under pgas_table_wise and TorchRec's table_wise side by side.
demo: install
	rm -rf $(DEMO_CHECKPOINT) && mkdir -p $(DEMO_CHECKPOINT)
	$(PY) examples/dlrm/make_criteo_sample.py $(DEMO_CHECKPOINT)/sample.tsv --lines 40000
	$(TORCHRUN) examples/dlrm/train.py --sharding pgas_table_wise --steps 300 \
		--data $(DEMO_CHECKPOINT)/sample.tsv --checkpoint $(DEMO_CHECKPOINT)/model
	$(TORCHRUN) examples/dlrm/infer.py --checkpoint $(DEMO_CHECKPOINT)/model \
		--shardings pgas_table_wise,table_wise

clean:
	rm -rf $(VENV) *.egg-info $(DEMO_CHECKPOINT)
