#!/usr/bin/env bash
# kimik3's two commands, on a fresh machine:
#   ./run.sh demo [args]   the main job: `kimik3 demo` (the agent workload end to end, tiny model)
#   ./run.sh test [args]   the test suite (CPU)
# Both create .venv with Python >= 3.12 and install the project on first use: its serve, store and plot
# extras, dev and reference (transformers + torch, the outside reference) for the tests, and cuda
# (jax[cuda13]) where nvidia-smi sees a GPU.
# On a machine without a package registry whose Python already holds CUDA jax (a GPU image):
#   KIMIK3_INHERIT_SITE=1  the venv also sees the packages of the Python that made it
#   KIMIK3_CUDA=local      jax[cuda13-local]: the machine's CUDA 13, not pip's CUDA wheels
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR   (pip's own) the missing wheels from DIR
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  local cands=()
  [ -n "${PYTHON:-}" ] && cands+=("$PYTHON")
  if command -v pyenv >/dev/null 2>&1; then
    local root; root=$(pyenv root)
    cands+=("$root"/versions/3.1[2-9]*/bin/python3.1[2-9])
  fi
  cands+=(python3.13 python3.12 python3)
  for c in "${cands[@]}"; do
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  echo "run.sh: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
  return 1
}

extras_for() {  # serve + store + plot always, dev + reference for the tests, cuda where an NVIDIA GPU answers
  local extras="serve,store,plot" driver
  [ "$1" = test ] && extras="$extras,dev,reference"
  if [ -n "${KIMIK3_EXTRAS:-}" ]; then  # an override: e.g. KIMIK3_EXTRAS=serve,store (no CUDA)
    echo "$KIMIK3_EXTRAS"; return 0
  fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)
    if [ "${driver%%.*}" -ge 580 ] 2>/dev/null; then  # jax[cuda13] needs driver 580 or newer
      if [ "${KIMIK3_CUDA:-pip}" = local ]; then extras="$extras,cuda-local"; else extras="$extras,cuda"; fi
    else
      echo "run.sh: NVIDIA driver ${driver:-unknown} is older than 580, which CUDA 13 (jax[cuda13]) needs: installing" \
           "without CUDA (JAX runs on the CPU); update the driver, or set KIMIK3_EXTRAS" >&2
    fi
  fi
  echo "$extras"
}

ensure_venv() {
  local stamp=.venv/.installed want have="" e
  want=$(extras_for "$1")
  if [ ! -x .venv/bin/python ]; then
    local py; py=$(find_python)
    "$py" -m venv .venv
    if [ -n "${KIMIK3_INHERIT_SITE:-}" ]; then  # a .pth: the creator's site-packages, after the venv's own
      local own; own=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      "$py" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        > "$own/_kimik3_inherited_site.pth"
      echo "run.sh: .venv also sees $(paste -sd' ' "$own/_kimik3_inherited_site.pth")" >&2
    fi
  fi
  if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
    have=$(cat "$stamp")
    local missing=""
    for e in ${want//,/ }; do [[ ",$have," == *",$e,"* ]] || missing=1; done
    [ -z "$missing" ] && return 0
    want="${have:+$have,}$want"  # keep what is there (test's dev when the demo runs, and the other way)
  fi
  want=$(tr ',' '\n' <<<"$want" | grep -v '^$' | sort -u | paste -sd, -)
  echo "run.sh: installing kimik3[$want] into .venv (the first time: ~1.2 GB of wheels, a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install --progress-bar on -e ".[$want]"
  echo "$want" > "$stamp"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    ensure_venv demo
    exec .venv/bin/kimik3 demo "$@"
    ;;
  test)
    ensure_venv test
    # A test whose xdist worker dies of a native crash runs once more in a fresh worker, and only
    # such a test (a test that fails is never rerun).  The crashes seen (SIGSEGV / SIGABRT inside
    # XLA's CPU compiler, a different test each run) came from workers reaching vm.max_map_count;
    # tests/conftest.py now bounds the mappings, and this stays as the net for any other.
    exec .venv/bin/python -m pytest -n 2 --durations=15 --reruns 1 --only-rerun "crashed while running" "$@"
    ;;
  *)
    echo "usage: ./run.sh demo|test [args...]" >&2
    exit 2
    ;;
esac
