"""The coordinator: the public Generate API and the speculative round loop."""
