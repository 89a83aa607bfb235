"""The HTTP door: one FastAPI app on --http-port for every API it speaks (OpenAI's in server/openai,
Anthropic's in server/anthropic, Ollama's in server/ollama), the serving skeleton they share, and each
API's dialect (its error body and stream encoding)."""
