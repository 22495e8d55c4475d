# Two entry points for a fresh clone: `make train` (the main job) and `make test` (the test suite).
# Both create .venv/ on first use and install one tested set into it: torch 2.11.0 with triton 3.6.0, the pair every
# GPU figure in the README comes from (torch's CUDA 13.0 build; it runs on CPU-only machines too, through Triton's
# interpreter). Another pair: make test TORCH='torch==2.13.0' TRITON='triton==3.6.0' (tested on CPU only).
# VENV_FLAGS and PIP_FLAGS pass options to venv and pip (e.g. PIP_FLAGS='--index-url URL'); an offline host:
# docs/benchmarks.md.
PYTHON ?= python3
TORCH ?= torch==2.11.0
TRITON ?= triton==3.6.0
EXTRAS ?= train,test,transformers
VENV_FLAGS ?=
PIP_FLAGS ?=
# pytest workers: the CPU suite is sized for 2 cores; the gpu tests take ~25 GiB of GPU memory a worker
JOBS ?= 2
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.ready

.PHONY: train demo test test-gpu bench clean

$(READY): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -m pip install -q $(PIP_FLAGS) "$(TORCH)" "$(TRITON)"
	$(BIN)/python -m pip install -q $(PIP_FLAGS) -e ".[$(EXTRAS)]"
	touch $(READY)

# ARGS: Hydra overrides, e.g. make train ARGS="attn=flash seq_len=16k"
train: $(READY)
	$(BIN)/python scripts/train.py $(ARGS)

demo: $(READY)
	$(BIN)/python scripts/demo.py

# PYTHONSAFEPATH: `python -m` must not put the repo root on sys.path (its kernels/ is only flashtrain.kernels)
test: $(READY)
	PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q -n $(JOBS)

test-gpu: $(READY)
	PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q -m gpu -n $(JOBS)

bench: $(READY)
	$(BIN)/python scripts/bench/attention.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
