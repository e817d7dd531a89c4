#!/usr/bin/env bash
# The project's virtualenv (`make setup`): torch, every dependency at the version in constraints.txt, SGLang's
# contract files, and this package installed editable.
#
# The dependencies are built once per machine under $MCORE_RL_CACHE_DIR/venvs/ (else ~/.cache/mcore_rl/venvs/), named
# by the sha256 of setup.py, constraints.txt, the contract fetcher, these scripts, the torch pin and the Python
# version: torch first (a CPU build here; an unpinned torch would pull CUDA wheels), then the package with its test
# extra, which is then uninstalled so that the copy holds only its dependencies (about 85 s on 2 cores with pip's
# cache warm). Each clone's .venv is a hard-linked copy of it (a plain copy where the cache is on another file
# system): its scripts' paths are rewritten to the clone's, which gives those few files their own inode, and the
# package is installed editable into it (a few seconds). Nothing at run time writes into an existing file under
# site-packages, so the links stay shared; installing or removing a package in a clone replaces or unlinks files and
# leaves the machine's copy as it was. tools/machine_copy.sh builds the copy (one build at a time; the three newest
# kept).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
key=$(
  {
    cat setup.py constraints.txt tools/fetch_sglang_contract.py tools/make_venv.sh tools/machine_copy.sh
    echo "$TORCH"
    "$PYTHON" -c 'import sys; print(sys.version)'
  } | sha256sum | cut -c1-16
)
build() {
  "$PYTHON" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
  "$1/bin/python" -m pip install -q -c constraints.txt "$TORCH"
  "$1/bin/python" -m pip install -q -c constraints.txt -e '.[test]'
  "$1/bin/python" -m pip uninstall -q -y mcore_rl
  "$1/bin/python" tools/fetch_sglang_contract.py --dest "$1/sglang-0.5.23"
}
source tools/machine_copy.sh
machine_copy base "$key" build
rm -rf .venv
trap 'rm -rf .venv' ERR
cp -al "$shared" .venv 2>/dev/null || { rm -rf .venv && cp -a "$shared" .venv; }
rm -f .venv/.installed
here=$(pwd)/.venv
# the scripts (pip, pytest, ray, activate ...) name the interpreter and the prefix by absolute path
{ grep -lIF "$shared" .venv/bin/* .venv/pyvenv.cfg || true; } | while read -r f; do sed -i "s#$shared#$here#g" "$f"; done
.venv/bin/python -m pip install -q --no-deps -e .
echo ".venv: a copy of $shared with this package installed editable"
