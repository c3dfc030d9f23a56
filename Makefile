# `make run` sets everything up and runs the main job; `make test` runs the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup run tour test test-fast lint bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt scripts/setup.sh
	bash scripts/setup.sh

TEXT ?= The old lighthouse keeper climbed the stairs every night to light the lamp. The old lighthouse keeper climbed the stairs every night to light the lamp.
ARGS ?=

# The main job: every head of a real decoder (SmolLM2-135M, bundled offline) on a text with
# a repeated passage: a summary of the roles, the induction heads and their causal check
# (ablated against as many random heads), a self-contained HTML head view, a PNG grid and
# the full table (out/heads.json; on the terminal too with `make run ARGS=--all`).
run: setup
	@mkdir -p out
	$(PY) -m multihead inspect "$(TEXT)" --model smollm2 --html out/head_view.html --png out/heads.png --table out/heads.json $(ARGS)

tour: setup
	$(PY) -m multihead tour

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

test: setup lint
	$(PY) -m pytest -q -n 2 --dist loadfile

# What a developer runs between edits: no real model, browser, multi-process or wheel
# tests (1,603 tests): 58 s on the idle 2-vCPU VM (2026-12-01), 7 min 50 s when other jobs
# held it at a load average of 9 (2026-11-30). For one area, run its files
# (`.venv/bin/pytest -q tests/test_plan*.py`: seconds). CI runs everything (`make test`:
# 2 min 24 s idle, the same day).
test-fast: setup
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not browser and not distributed"

bench: setup
	$(PY) benchmarks/attention.py
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/local_decode.py
	$(PY) benchmarks/masks.py  # ~25 min on 2 cores (the math path it is held against is slow)
