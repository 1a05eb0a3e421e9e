# Two commands set everything up on a fresh machine:
#   make run   - create .venv if missing, install, run the main job (`fuseflow train`)
#   make test  - same install, then the test suite (CI deselects `slow`)
#   make test-gpu - the CUDA tests (`gpu` marker) in .venv if there is one, else in $(PYTHON): on a GPU
#                   machine install your own CUDA torch and `pip install -e ".[dev]"` first (docs/gpu.md)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The .venv pins CPU torch, where the gpu tests only skip; GPU_PY=... picks another interpreter.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

.PHONY: install run test test-slow test-gpu lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,real]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/fuseflow train

test: install
	$(BIN)/python -m pytest -q -m "not slow" tests

test-slow: install
	$(BIN)/python -m pytest -q -m slow tests

test-gpu:
	$(GPU_PY) -m pytest -q -m gpu tests

lint: install
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
