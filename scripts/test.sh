#!/usr/bin/env bash
# Set up, check lint, formatting and types, then run the test suite (CI runs exactly this).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The deploy check's tools (.venv-deploy) install beside the main set-up: both are mostly download.
deploy/check.sh --install-only &
deploy_tools=$!
scripts/setup.sh --test
wait "$deploy_tools"
export HF_HUB_OFFLINE=1
# Lint, formatting and types (configured in pyproject.toml) before the tests: any finding fails the run.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# Two pytest-xdist workers (about half the time on two cores: the tests mostly wait on servers and
# child processes), each given whole test files, the files on the shared in-process services all to
# one (tests/conftest.py: xdist groups, one torch thread and its own ports per worker);
# SPECDEC_TEST_WORKERS=0 runs them in this process (docs/architecture.md#development).
workers=()
if [ "${SPECDEC_TEST_WORKERS:-2}" != 0 ]; then
  workers=(-n "${SPECDEC_TEST_WORKERS:-2}" --dist loadgroup)
fi
status=0
.venv/bin/python -m pytest "${workers[@]}" "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing, a green run must test something" >&2
  exit 1
fi
exit "$status"
