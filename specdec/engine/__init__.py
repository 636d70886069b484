"""The engine: models loaded for batched forwards, each session's KV cache with rollback, the paged
KV store's budget and prefix cache, and the loop that runs every pending call of every session in
one forward per step (:mod:`specdec.engine.engine`)."""
