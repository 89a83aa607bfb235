"""The one path of a chat request, whichever door it came in by: the tools' call format, the
conversation through the chat template, reasoning, the output constrained to the calls' grammar, and
the EngineRequest with the AnswerReader that reads its outputs back."""
import re

from pagoda.engine.core.core_io import EngineRequest
from pagoda.engine.errors import InvalidRequestError
from pagoda.server.chat.answer import AnswerReader
from pagoda.server.chat.reasoning import reasoning_for
from pagoda.server.chat.tools import ToolParsing, ToolRequest, constrain, tool_format


def chat_request(engine, messages: list[dict], params, make, *, tools: ToolRequest | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 template_kwargs: dict | None = None) -> tuple[EngineRequest, AnswerReader]:
    """A conversation (the chat template's dicts, checked by its door) and its checked tools as an
    EngineRequest and its AnswerReader. make(prompt_ids, params) -> the EngineRequest (the door's
    request id, priority and limits)."""
    fmt = tools and tool_format(engine.tokenizer, tool_call_parser)
    ids = render(engine, messages, tools and tools.tools, template_kwargs)
    reasoning = reasoning_for(engine.tokenizer, ids, reasoning_parser)
    params, parsing = constrain(tools, fmt, params, engine.tokenizer, reasoning)
    return _made(lambda: make(ids, params), parsing), AnswerReader(parsing, reasoning)


def render(engine, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None) -> list[int]:
    """A conversation's prompt token ids, through the model's chat template (with the tools, as sent);
    what the template refuses is InvalidRequestError naming `messages` (engine/inputs.py chat_prompt_ids)."""
    return engine.apply_chat_template(messages, tools, template_kwargs)


def _made(make, parsing: ToolParsing | None) -> EngineRequest:
    """make(); a tool's parameters schema that llguidance refuses is named as `tools`."""
    try:
        return make()
    except InvalidRequestError as e:
        if not (parsing and e.field.startswith("structured_outputs")):
            raise
        why = re.split(r" \d+ \| ", e.message)[0].replace("is invalid: ", "")  # not the grammar's lines
        raise InvalidRequestError("tools", f"hold a parameters schema that cannot be enforced: {why}") from None
