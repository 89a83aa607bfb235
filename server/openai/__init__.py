"""The OpenAI-compatible HTTP door (vLLM's entrypoints/openai): protocol.py the requests, serving.py
the skeleton every generation shares, one module per endpoint, sse.py the events, app.py the app."""
