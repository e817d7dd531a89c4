# Sourced by tools/make_venv.sh and tools/make_vllm_venv.sh: a directory built once per machine and key.
#
# machine_copy PREFIX KEY BUILD: sets $shared to $MCORE_RL_CACHE_DIR/venvs/PREFIX-KEY (else under ~/.cache/mcore_rl)
# and, unless a finished copy is there, runs `BUILD <dir>` to make one. One build at a time (flock on PREFIX.lock); a
# failed build removes its half-built directory; `.installed` marks a finished copy. The three newest PREFIX-*
# copies (older pins) are kept.
machine_copy() {
  local prefix=$1 key=$2 build=$3 root
  root=${MCORE_RL_CACHE_DIR:-$HOME/.cache/mcore_rl}/venvs
  shared=$root/$prefix-$key
  mkdir -p "$root"
  (
    set -E
    flock 9
    if [ ! -f "$shared/.installed" ]; then
      rm -rf "$shared"
      trap 'rm -rf "$shared"' ERR
      "$build" "$shared"
      touch "$shared/.installed"
      ls -1dt "$root/$prefix"-*/ 2>/dev/null | tail -n +4 | xargs -r rm -rf
    fi
  ) 9>"$root/$prefix.lock"
}
