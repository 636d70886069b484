"""The round path: one request's rounds, adaptive K, the draft side, failover between verify
replicas, and the clients of the draft and verify services."""
