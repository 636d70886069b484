#!/usr/bin/env bash
# Checks deploy/ without a cluster or a container engine (tests/test_deploy.py runs it, so the
# README's test command and CI do):
#   1. render every overlay in deploy/k8s/overlays with `kubectl kustomize` (kubectl required);
#   2. validate the output against the Kubernetes $KUBERNETES_VERSION schemas, strict, with
#      kubernetes-validate (schemas ship in the package), custom resources against deploy/schemas;
#   3. checkov on the rendered manifests and on the Dockerfiles (offline: --skip-download);
#   4. hadolint on the Dockerfiles.
# Any finding fails. The tools live in .venv-deploy at the versions locked in
# deploy/requirements-check.txt (scripts/lock.sh writes it), apart from .venv: checkov would downgrade
# packages that torch and transformers use there.
# `deploy/check.sh --install-only` installs the tools and stops (scripts/test.sh does that during
# its set-up, beside the main install, so the test does not pay for it).
set -euo pipefail
cd "$(dirname "$0")/.."
KUBERNETES_VERSION=${KUBERNETES_VERSION:-1.32.0}
venv=.venv-deploy
out=.deploy-check

# (Re)install the tools when the lock changes.
if ! cmp -s deploy/requirements-check.txt "$venv/requirements-check.txt" 2>/dev/null; then
  echo "== installing the check's tools into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  if ! "$venv/bin/pip" install -q --disable-pip-version-check -r deploy/requirements-check.txt \
      >"$venv.log" 2>&1; then
    cat "$venv.log" >&2
    exit 1
  fi
  cp deploy/requirements-check.txt "$venv/requirements-check.txt"
fi
[ "${1:-}" = "--install-only" ] && exit 0

if ! command -v kubectl >/dev/null; then
  echo "deploy/check.sh: kubectl not found; install kubectl (it bundles Kustomize) to render deploy/k8s" >&2
  exit 1
fi

rm -rf "$out"
mkdir -p "$out/manifests"
echo "== kubectl kustomize ($(kubectl version --client 2>/dev/null | grep -i kustomize || echo 'Kustomize version unknown'))"
for overlay in deploy/k8s/overlays/*/; do
  name=$(basename "$overlay")
  kubectl kustomize "$overlay" >"$out/manifests/$name.yaml"
  echo "rendered $overlay -> $out/manifests/$name.yaml"
done

echo "== kubernetes-validate, Kubernetes $KUBERNETES_VERSION"
"$venv/bin/python" deploy/validate.py --kubernetes-version "$KUBERNETES_VERSION" "$out"/manifests/*.yaml

# checkov: the findings that fail, and the totals; skips are annotations/comments in the files.
export BC_SKIP_MAPPING=TRUE
echo "== checkov: rendered manifests"
"$venv/bin/checkov" --framework kubernetes --skip-download --quiet --compact -d "$out/manifests"
echo "== checkov: Dockerfiles"
"$venv/bin/checkov" --framework dockerfile --skip-download --quiet --compact \
  $(printf -- "-f %s " deploy/docker/Dockerfile.*)

echo "== hadolint: Dockerfiles"
"$venv/bin/hadolint" deploy/docker/Dockerfile.*
echo "hadolint $("$venv/bin/hadolint" --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+'): no findings"
echo "deploy/check.sh: all checks passed"
