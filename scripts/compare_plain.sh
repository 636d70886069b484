#!/usr/bin/env bash
# Spot check until `specdec bench` exists: pipeline (K=4, llama-cpp and ngram) vs K=0 plain decode
# on the first summarization, qa and math_reasoning Spec-Bench prompts, greedy, 128 new tokens,
# all in one run against one `specdec up`. Prints one line per (prompt, configuration).
set -euo pipefail
cd "$(dirname "$0")/.."
QUESTIONS=${QUESTIONS:-../shared/benchmarks/spec_bench/question.jsonl}
. .venv/bin/activate
export HF_HUB_OFFLINE=1
log=$(mktemp)
specdec up --coordinator-port 51051 --draft-port 51052 --verify-port 51053 2>"$log" &
up=$!
trap 'kill -INT $up; wait $up' EXIT
until grep -q "all services SERVING" "$log"; do kill -0 $up; sleep 1; done
for category in summarization qa math_reasoning; do
  prompt=$(python -c "import json, sys; print(next(q['turns'][0] for q in map(json.loads, open(sys.argv[1])) if q['category'] == sys.argv[2]))" "$QUESTIONS" "$category")
  for config in "0 ngram" "4 llama-cpp" "4 ngram"; do
    read -r k drafter <<<"$config"
    specdec generate "$prompt" --coordinator 127.0.0.1:51051 -k "$k" --drafter "$drafter" --max-new-tokens 128 --json 2>/dev/null \
      | tail -1 | python -c "
import json, sys
r = json.load(sys.stdin); m = r['metrics']
decode_s = (m['total_time_ms'] - m['prefill_time_ms']) / 1000
print(f\"$category K=$k $drafter: tokens={len(r['token_ids'])} tok/s={m['tokens_per_second']:.1f} \"
      f\"decode_tok/s={len(r['token_ids']) / decode_s:.1f} acceptance_rate={m['draft_acceptance_rate']:.3f} \"
      f\"mean_acceptance_length={m['mean_acceptance_length']:.2f} prompt={m['num_prompt_tokens']} \"
      f\"prefill_ms={m['prefill_time_ms']:.0f} draft/verify/coord_ms={m['draft_time_ms']:.0f}/{m['verify_time_ms']:.0f}/{m['coordination_time_ms']:.0f} \"
      f\"ids_sha={__import__('hashlib').sha256(str(r['token_ids']).encode()).hexdigest()[:10]}\")"
  done
done
