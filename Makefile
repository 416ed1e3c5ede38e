# lightning-ddpm: `make train` and `make test` install into .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
# pytest-xdist processes for make test (each test file stays on one worker: --dist loadfile)
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help
.PHONY: help install train sample test test-fast lint format clean gpu-wheels

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
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

test-fast: $(STAMP)  ## the suite without the tests marked slow
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(ARGS)

lint: $(STAMP)  ## ruff lint and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)  ## ruff fix and format
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The lent GPU machine (Python 3.12, no network) has torch, lightning, torchmetrics, safetensors, numpy, PyYAML,
# huggingface-hub, filelock, regex, requests, Pillow, packaging (/work/.library/device/KINDS.md's package list), not
# these: each is named, since --no-deps fetches no dependency (diffusers' importlib_metadata is imported on Python < 3.8
# only). Versions: pyproject.toml's pins, else what `make install` resolved. benchmarks/gpu.sh installs them there.
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 diffusers==0.42.1
GPU_SDISTS := antlr4-python3-runtime==4.9.3  # omegaconf's parser: an sdist only, built here into a pure-Python wheel
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64

gpu-wheels:  ## the wheels the GPU machine lacks (Python 3.12, x86-64) into .whl/, for benchmarks/gpu.sh
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .whl $(GPU_WHEELS)
	$(PYTHON) -m pip wheel --quiet --no-deps -w .whl $(GPU_SDISTS)
	@ls .whl && du -sh .whl

clean:  ## remove caches (keeps .venv, outputs/ and multirun/)
	rm -rf .pytest_cache .ruff_cache src/*.egg-info
	find . -name __pycache__ -not -path './.venv/*' -prune -exec rm -rf {} +
