"""The draft service: hosts drafters and their per-session KV state, proposes draft tokens."""
