"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): a thin translator over the
one chat layer (server/chat), answering in Anthropic's shapes, events and errors."""
