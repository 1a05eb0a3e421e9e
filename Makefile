# Two commands set everything up on a fresh machine:
#   make run   - create .venv if missing, install, run the main job (`fuseflow train`)
#   make test  - same install, then the test suite (CI deselects `slow`)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test test-slow lint clean

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

lint: install
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
