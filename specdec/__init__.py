"""specdec: speculative decoding as a distributed gRPC service.

This package is the shared core used by the coordinator, the draft service and the verify
service: model loading, KV-cached sessions with rollback, sampling transforms, the acceptance
test, vocabulary fingerprints, gRPC server plumbing and the generated ``specdec.v1`` stubs.
"""
