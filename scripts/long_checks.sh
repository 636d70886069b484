#!/usr/bin/env bash
# The long checks (tests marked `long`), left out of the suite's run for their time (about 8
# minutes on 2 cores): the soak test (tests/test_soak.py: 64 concurrent streams with cancels,
# disconnects and resumes, then no session left, memory back within 10%, every greedy output
# plain), the fault matrix's cells the suite leaves out (tests/test_faults.py: the suite runs a
# pairwise-covering half) and constrained output through a draft and a verify kill, the replicas
# behind DNS names (tests/test_replicas.py), a dead engine loop's exit and restart and SIGTERM
# with the transformers drafter (tests/test_supervision.py: the suite runs the hung step and
# llama.cpp), and the smoke runs of `specdec bench` (batch 1, structured output, under a network,
# its ceiling mode over the OpenAI API) and of guidellm against the HTTP API, on the tiny models.
# Run them before resolving a change to sessions, cancels, resume, memory, fault recovery,
# replicas, supervision or the bench. Needs the project's .venv (scripts/setup.sh --test); extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "scripts/long_checks.sh: no .venv; run scripts/setup.sh --test first" >&2
  exit 1
fi
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest --long -m long -p no:randomly "$@"
