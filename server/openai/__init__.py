"""OpenAI's API on the HTTP door (vLLM's entrypoints/openai): protocol.py the requests, errors.py OpenAI's
error object, one module per endpoint; the app, the serving skeleton and the dialects are server/http's."""
