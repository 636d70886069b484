"""The coordinator's public APIs: request validation and choices, the stream output, the
OpenAI-compatible HTTP API, API keys and limits, and the public client of Generate."""
