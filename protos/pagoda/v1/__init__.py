"""pagoda.v1: generated from generation.proto by protos/generate.py; do not edit the *_pb2* files."""
