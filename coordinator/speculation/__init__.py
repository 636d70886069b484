"""The round path: one request's rounds (rounds.py) and their input (plan.py), the K policy
(policy/), the clients of the draft and the verify service (draft_client.py, verify_client.py),
placement and discovery of their replicas, and the gRPC calls to them (upstream.py)."""
