"""The chat layer, one home for every door (OpenAI chat and Responses, gRPC messages): a conversation
through the model's chat template, its tools and reasoning, the output constrained to the tools'
grammar, and the answer read back. The engine sees token ids, sampling and grammars only.

  requests.py   chat_request: a door's conversation -> (EngineRequest, AnswerReader)
  tools.py      tool-call formats, their grammars and parsing; a request's tools checked
  reasoning.py  <think>...</think> read apart, and constrained output only after it
  answer.py     AnswerReader: a completion's text read back, whole or as a stream

The parsers' names (vLLM's), listed once: --tool-call-parser and --reasoning-parser take these."""

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
