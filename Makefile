# lightning-ddpm: `make train` and `make test` install into .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
# pytest-xdist processes for make test (each test file stays on one worker: --dist loadfile)
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help
.PHONY: help install train sample test test-fast lint format clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found; run make PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)  ## make .venv and install the pinned dependencies (editable)

train: $(STAMP)  ## train the default experiment (sklearn digits, CPU, a few minutes); ARGS='key=value ...'
	$(BIN)/python train.py $(ARGS)

sample: $(STAMP)  ## sample from a run: make sample ARGS='ckpt=outputs/.../ema.pt'
	$(BIN)/python sample.py $(ARGS)

test: $(STAMP)  ## the whole test suite (slow tests included), TEST_WORKERS=2 files at a time
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-fast: $(STAMP)  ## the suite without the tests marked slow
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(ARGS)

lint: $(STAMP)  ## ruff lint and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)  ## ruff fix and format
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:  ## remove caches (keeps .venv, outputs/ and multirun/)
	rm -rf .pytest_cache .ruff_cache src/*.egg-info
	find . -name __pycache__ -not -path './.venv/*' -prune -exec rm -rf {} +
