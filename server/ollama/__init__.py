"""Ollama's API (/api/chat, /api/generate, /api/tags, ...): a thin translator over the one chat layer
(server/chat), answering in Ollama's shapes, NDJSON streams and errors."""
