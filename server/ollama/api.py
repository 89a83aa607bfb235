"""Ollama's endpoints."""
from __future__ import annotations

from pagoda.server.openai.serving import Serving


class Ollama:
    def __init__(self, serving: Serving):
        self.serving = serving

    def routes(self) -> list:
        return []
