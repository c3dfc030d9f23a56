# `make run` sets everything up and runs the main job; `make test` runs the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup run test lint bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt scripts/setup.sh
	bash scripts/setup.sh

run: setup
	$(PY) -m multihead

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

test: setup lint
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: setup
	$(PY) benchmarks/attention.py
	$(PY) benchmarks/decode.py
