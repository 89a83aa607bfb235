"""Generated gRPC stubs of the pagoda API (package pagoda.v1); see protos/generate.py."""
