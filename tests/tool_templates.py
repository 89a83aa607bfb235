"""Tokenizers with tool-capable chat templates, built locally: byte-level BPE (engine/demo.py's) with
the family's markers as added tokens and a chat template written after the family's own (Qwen2.5's
Hermes-style, Llama 3.1's JSON calls, Mistral's [TOOL_CALLS]), shortened but rendering tools,
assistant tool calls and tool results the way the originals do; `tool_server` serves one."""
import contextlib

from tokenizers import AddedToken

QWEN = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA31 = r"""
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" + message.content + "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

MISTRAL = r"""
{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'system' %}
        {{- message.content + '\n\n' }}
    {%- elif message.tool_calls %}
        {{- '[TOOL_CALLS][' }}
        {%- for tc in message.tool_calls %}
            {{- {"name": tc.function.name, "arguments": tc.function.arguments, "id": tc.id}|tojson }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- message.content + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]' + {"content": message.content, "call_id": message.tool_call_id}|tojson + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

# Qwen3's: Qwen2.5's with reasoning (enable_thinking false writes an empty <think></think> block)
QWEN3 = QWEN.replace("""{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}""",
                     """{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is """
                     """defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"""
                     """{%- endif %}""")
assert QWEN3 != QWEN

# family -> (template, added special tokens, added plain tokens): Qwen's <tool_call> is an added token
# that is not special (it stays in decoded text); Mistral's [TOOL_CALLS] and Llama's headers are special
FAMILIES = {
    "qwen": (QWEN, ["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"]),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>", "<think>", "</think>"]),
    "llama": (LLAMA31, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"], []),
    "mistral": (MISTRAL, ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], []),
}


def build_tool_tokenizer(family: str):
    from pagoda.engine.demo import build_byte_tokenizer

    template, special, plain = FAMILIES[family]
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.chat_template = template.strip()
    return tok


def build_tool_checkpoint(path: str, family: str) -> str:
    from pagoda.engine.demo import build_tiny_checkpoint

    arch = {"qwen": "llama", "qwen3": "qwen3", "llama": "llama", "mistral": "mistral"}[family]
    return build_tiny_checkpoint(path, arch, initializer_range=0.3, tokenizer=build_tool_tokenizer(family),
                                 max_position_embeddings=4096)


@contextlib.contextmanager
def tool_server(tmp_path_factory, family: str, **engine_options):
    """An in-process server (HTTP on a free port, the model named "m") over a tool-capable checkpoint
    of `family`, stopped on exit."""
    from grpc_fixtures import InProcessServer, engine_config
    from pagoda.server.options import ServerOptions

    path = build_tool_checkpoint(str(tmp_path_factory.mktemp(family)), family)
    server = InProcessServer.for_config(engine_config(path, **engine_options),
                                        ServerOptions(http_port=0, served_model_names=("m",))).wait_ready()
    try:
        yield server
    finally:
        server.stop()
