"""Speculative decoding: proposers (n-gram, draft model) and acceptance, beside the runner."""
