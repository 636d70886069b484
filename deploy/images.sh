#!/usr/bin/env bash
# Builds specdec's CPU image with podman on a machine that reaches Debian's archive and a Python
# package index but no container registry (see docs/deployment.md#images):
#   1. podman, runc, catatonit (podman's pause process) and mmdebstrap from Debian's packages
#      (if missing);
#   2. a Debian base image made with mmdebstrap from the machine's own apt mirror,
#      localhost/debian:bookworm-minbase (about 90 s, once);
#   3. stand-ins for the official Python and Redis images from it,
#      localhost/specdec-python:3.11-bookworm and localhost/specdec-redis:bookworm
#      (deploy/docker/Dockerfile.python-debian and Dockerfile.redis-debian, once);
#   4. deploy/docker/Dockerfile.cpu FROM that stand-in, with the machine's CA bundle, pip settings
#      and local wheel folders mounted into the build's RUN steps (nothing of them stays in a
#      layer), tagged localhost/specdec:cpu-<source hash> and specdec:0.1.0-cpu. An image with
#      the same source hash is reused.
# Prints the CPU image's and the Redis image's references on its last line. Needs root (apt-get, podman's rootful storage).
# Where a registry is reachable, build the same Dockerfiles directly (docker build ...).
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF="$PWD/deploy/podman/containers.conf"
DEBIAN_IMAGE=localhost/debian:bookworm-minbase
PYTHON_IMAGE=localhost/specdec-python
PYTHON_TAG=3.11-bookworm
REDIS_IMAGE=localhost/specdec-redis:bookworm
WORK=.image-build
# What deploy/docker/Dockerfile.cpu copies from the build context, plus the files that shape it.
SOURCES=(.dockerignore deploy/docker pyproject.toml setup.py README.md proto specdec coordinator
  draft_service verify_service specdec_app)

install_engine() {
  command -v podman >/dev/null && command -v runc >/dev/null && command -v catatonit >/dev/null \
    && command -v mmdebstrap >/dev/null && return
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    podman runc catatonit mmdebstrap uidmap slirp4netns fuse-overlayfs >/dev/null
}

# The first Debian mirror of the machine's apt sources (deb822 or one-line format).
debian_mirror() {
  cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
    | awk '/^URIs:/ && $2 !~ /security/ {print $2; exit} /^deb / && $2 !~ /security/ {print $2; exit}'
}

base_images() {
  if ! podman image exists "$DEBIAN_IMAGE"; then
    echo "== $DEBIAN_IMAGE: mmdebstrap from $(debian_mirror)" >&2
    mkdir -p "$WORK"
    mmdebstrap --quiet --variant=minbase bookworm "$WORK/base.tar" "$(debian_mirror)"
    podman import --quiet "$WORK/base.tar" "$DEBIAN_IMAGE" >/dev/null
    rm -f "$WORK/base.tar"
  fi
  if ! podman image exists "$PYTHON_IMAGE:$PYTHON_TAG"; then
    echo "== $PYTHON_IMAGE:$PYTHON_TAG" >&2
    podman build --quiet -f deploy/docker/Dockerfile.python-debian -t "$PYTHON_IMAGE:$PYTHON_TAG" deploy/docker >/dev/null
  fi
  if ! podman image exists "$REDIS_IMAGE"; then
    echo "== $REDIS_IMAGE" >&2
    podman build --quiet -f deploy/docker/Dockerfile.redis-debian -t "$REDIS_IMAGE" deploy/docker >/dev/null
  fi
}

# A hash of every file the build reads (tracked or not, as they are on disk now).
source_hash() {
  git ls-files --cached --others --exclude-standard -- "${SOURCES[@]}" | sort | while read -r file; do
    [ -f "$file" ] && sha256sum "$file"
  done | sha256sum | cut -c1-12
}

# pip's settings inside the build: the machine's CA bundle, its wheel folders and constraints.
pip_mounts() {
  local conf="$WORK/pip/pip.conf" links constraint
  mkdir -p "$WORK/pip"
  printf '[global]\ncert = /etc/ssl/certs/host-ca.crt\n' >"$conf"
  echo "-v $PWD/$WORK/pip:/etc/xdg/pip:ro -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/host-ca.crt:ro"
  links=$(pip config get global.find-links 2>/dev/null || true)
  for dir in $links; do
    [ -d "$dir" ] && echo "-v $dir:$dir:ro"
  done
  [ -n "$links" ] && echo "find-links = $links" >>"$conf"
  constraint=$(pip config get global.constraint 2>/dev/null || true)
  if [ -f "$constraint" ]; then
    cp "$constraint" "$WORK/pip/constraints.txt"
    echo "constraint = /etc/xdg/pip/constraints.txt" >>"$conf"
  fi
}

build_cpu() {
  local image="localhost/specdec:cpu-$(source_hash)"
  if podman image exists "$image"; then
    echo "== $image: built already" >&2
  else
    echo "== $image: podman build (llama.cpp compiles once, in a cached stage)" >&2
    # shellcheck disable=SC2046  # one word per option
    podman build --layers --build-arg BASE_IMAGE="$PYTHON_IMAGE" --build-arg BASE_TAG="$PYTHON_TAG" \
      --build-arg TORCH_INDEX_URL=https://pypi.org/simple $(pip_mounts) \
      -f deploy/docker/Dockerfile.cpu -t "$image" -t localhost/specdec:0.1.0-cpu . >&2
  fi
  echo "$image $REDIS_IMAGE"
}

install_engine
base_images
build_cpu
