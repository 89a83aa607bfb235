"""POST /v1/messages and /v1/messages/count_tokens."""
from __future__ import annotations

from pagoda.server.openai.serving import Serving


class Messages:
    def __init__(self, serving: Serving):
        self.serving = serving

    def routes(self) -> list:
        return []
