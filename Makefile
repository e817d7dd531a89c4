# Two commands do all set-up on a fresh machine:
#   make run   -> the default job: a tiny RL run (GRPO, Qwen3-MoE-shaped model, EP=2 on 2 gloo ranks) on CPU
#   make test  -> the test suite
# Set-up creates .venv, installs torch==2.13.0 first (a CPU build here; an unpinned torch would pull CUDA wheels),
# then this package with its test extra, every dependency at the version in constraints.txt (what CI runs with;
# `make constraints` regenerates it from a working .venv), then extracts a few SGLang 0.5.23 source files (API structs, weight bucket,
# launch flags) into .venv/sglang-0.5.23/ for the contract tests; SGLang itself is not installed. It re-runs only
# when setup.py or the fetch script changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: run test lint setup clean constraints

$(STAMP): setup.py constraints.txt tools/fetch_sglang_contract.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(TORCH)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) tools/fetch_sglang_contract.py --dest $(VENV)/sglang-0.5.23
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m mcore_rl.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=40 tests $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

constraints: $(STAMP)
	$(PY) tools/freeze_constraints.py --out constraints.txt

clean:
	rm -rf $(VENV) runs outputs *.egg-info
