#!/usr/bin/env bash
# The main job: set up, then stream one real prompt through the three services on the default
# models (SmolLM2-135M-Instruct target, its llama.cpp Q4_1 self-draft) and print the metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/specdec demo "$@"
