#!/usr/bin/env bash
# The main job: set up, then stream one real prompt through the three services on the default
# models (SmolLM2-135M-Instruct target, its GGUF self-draft in llama.cpp, re-quantized to Q8_0) and print the metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/specdec demo "$@"
