"""Generated gRPC stubs of the specdec.v1 API (built from proto/ at install time; see setup.py)."""
