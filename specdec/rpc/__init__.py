"""The services' RPC plumbing: the gRPC server set-up, the Step streams' two ends (the service's,
:mod:`specdec.rpc.step_server`, and the coordinator's, :mod:`specdec.rpc.step_client`), errors
mapped to status codes, TLS, per-session state, the wire form of tensors and the load a service
reports. The unary Verify, Decode and Propose RPCs are the debugging path; rounds go over Step."""
