"""``specdec bench``: plain decoding, transformers' assisted generation and the speculative pipeline
on the same Spec-Bench prompts, interleaved per prompt, with JSON, Markdown and PNG reports
(benchmark protocol of the design brief)."""
