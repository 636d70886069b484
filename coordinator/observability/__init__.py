"""Per-request metrics, the Prometheus metrics and the span attributes."""
