# Two entry points for a fresh clone:  `make train` (the main job) and `make test` (the test suite).
# Both create .venv/ on first use. Override TORCH to pick another build, e.g. TORCH='torch==2.11.0'.
PYTHON ?= python3
TORCH ?= torch==2.13.0
# triton 3.6 is what the GPU box runs; pinned so CPU (interpreter) runs test the same kernel compiler.
TRITON ?= triton==3.6.0
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.ready

.PHONY: train demo test test-gpu bench clean

$(READY): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" "$(TRITON)"
	$(BIN)/python -m pip install -q -e ".[test,transformers]"
	touch $(READY)

# ARGS: Hydra overrides, e.g. make train ARGS="attn=flash seq_len=16k"
train: $(READY)
	$(BIN)/python scripts/train.py $(ARGS)

demo: $(READY)
	$(BIN)/python scripts/demo.py

test: $(READY)
	$(BIN)/pytest -q

test-gpu: $(READY)
	$(BIN)/pytest -q -m gpu

bench: $(READY)
	$(BIN)/python scripts/bench_attention.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
