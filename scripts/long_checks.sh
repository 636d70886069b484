#!/usr/bin/env bash
# The long checks (tests marked `long`), left out of the suite's run for their time (about 3
# minutes on 2 cores): the soak test (tests/test_soak.py: 64 concurrent streams with cancels,
# disconnects and resumes, then no session left, memory back within 10%, every greedy output
# plain), the fault matrix's cells the suite leaves out (tests/test_faults.py: the suite runs a
# pairwise-covering half), and the smoke runs of `specdec bench` under a network and of its
# ceiling mode over the OpenAI API on the tiny models. Run them before resolving a change to
# sessions, cancels, resume, memory, fault recovery or the bench. Needs the project's .venv
# (scripts/setup.sh --test); extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "scripts/long_checks.sh: no .venv; run scripts/setup.sh --test first" >&2
  exit 1
fi
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest --long -m long -p no:randomly "$@"
