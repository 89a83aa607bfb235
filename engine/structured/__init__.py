"""Structured outputs: grammars compiled by llguidance and their token masks."""
