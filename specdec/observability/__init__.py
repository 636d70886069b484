"""What every service exports: Prometheus metrics and their endpoint, tracing and logging set-up."""
