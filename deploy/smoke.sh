#!/usr/bin/env bash
# Smoke test of the deployment as a new user meets it, on one machine without a cluster or a
# container registry (docs/deployment.md#smoke-test): builds the CPU image (deploy/images.sh, which
# installs podman and reuses an image of the same source hash), renders the local overlay and runs
# it as containers with `podman kube play`, waits for each service's readiness probe, checks a
# gRPC Generate and an HTTP chat completion against plain decoding, kills the draft container and
# checks that requests go on and speculate again, tears everything down (deploy/smoke.py has the
# details). The draft and verify services run as two pods each (--replicas N to change), named to
# the coordinator one by one: podman has no DNS for a headless Service. Its last lines say what it
# could not run and sum up: cold start to SERVING per pod, the image size, sessions per replica.
# Not part of the test suite (a first run builds for about 15 minutes on 2 cores); run it before
# resolving any change to deploy/. Needs root, kubectl and the project's .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "deploy/smoke.sh: no .venv; run scripts/setup.sh first" >&2
  exit 1
fi
export CONTAINERS_CONF="$PWD/deploy/podman/containers.conf"
read -r image redis_image < <(deploy/images.sh | tail -1)
exec .venv/bin/python deploy/smoke.py "$image" "$redis_image" "$@"  # e.g. --replicas 1
