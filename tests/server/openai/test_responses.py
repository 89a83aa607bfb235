"""POST /v1/responses through the `openai` SDK's client.responses (every answer and event checked
against OpenAI's specification): text, whole and streamed alike; function tools, their calls always
valid, and the function_call / function_call_output items of the next turn; text.format json_schema;
previous_response_id refused (stateless)."""
import json

import jsonschema
import openai
import pytest

from grpc_fixtures import openai_client, wait_all_blocks_free
from pagoda.client.client import Client
from tool_templates import tool_server

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
          "strict": True}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with tool_server(tmp_path_factory, "qwen", num_kv_blocks=256) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return openai_client(srv)


def test_text_whole_and_streamed(oai, srv):
    kw = dict(model="m", input="Grüß dich, 東京", instructions="Be brief.", max_output_tokens=12, temperature=0)
    whole = oai.responses.create(**kw)
    assert whole.object == "response" and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.usage.output_tokens == 12
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    wait_all_blocks_free(Client(srv.target, timeout=30))


def test_function_calls_and_the_next_turn(oai):
    for seed in range(3):
        r = oai.responses.create(model="m", input="Weather in Köln?", tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, temperature=1.0,
                                 extra_body={"seed": seed})
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and calls[0].call_id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        events = list(oai.responses.create(model="m", input="Weather in Köln?", tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_output_tokens=200, temperature=1.0,
                                           extra_body={"seed": seed}, stream=True))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [(e.name, e.arguments) for e in done] == [(calls[0].name, calls[0].arguments)]
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(deltas) == calls[0].arguments and len(deltas) >= 3  # in pieces, as they come
        kinds = [e.type for e in events]  # the item first, its arguments, then its ends
        assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta") \
            < kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    # the SDK's own output items sent back, with the function's result
    nxt = oai.responses.create(model="m", tools=TOOLS, max_output_tokens=4, tool_choice="none", input=[
        {"role": "user", "content": "Weather in Köln?"}, *[o.model_dump(exclude_none=True) for o in r.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12°C"}])
    assert all(o.type == "message" for o in nxt.output)


def test_named_function_and_auto_pushed_into_a_call(oai, srv):
    trigger = str(srv.engine.tokenizer.convert_tokens_to_ids("<tool_call>"))
    for choice, extra in (({"type": "function", "name": "get_weather"}, {}), ("auto", {"logit_bias": {trigger: 100}})):
        r = oai.responses.create(model="m", input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                                 tools=TOOLS, tool_choice=choice, max_output_tokens=300, extra_body=extra)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and all(jsonschema.validate(json.loads(c.arguments), WEATHER) is None for c in calls)


def test_json_schema_text_format(oai):
    r = oai.responses.create(model="m", input="A city?", max_output_tokens=100, text={"format": {
        "type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)


@pytest.mark.parametrize("kw, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"background": True}, "background"),
])
def test_bad_input_is_a_400_naming_the_field(oai, srv, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(**{"model": "m", "input": "hi", "max_output_tokens": 2, **kw})
    assert e.value.body["param"] == param, e.value.body
    assert srv.engine.num_in_flight == 0


def test_echoed_function_tools_carry_strict(oai):
    """OpenAI's spec requires `strict` on a Response's function tools: as sent, else true (every call enforced)."""
    loose = {k: v for k, v in TOOLS[0].items() if k != "strict"}
    lax = {**loose, "name": "get_time", "strict": False}
    r = oai.responses.create(model="m", input="hi", tools=[loose, lax], tool_choice="none", max_output_tokens=2)
    assert [(t.name, t.strict) for t in r.tools] == [("get_weather", True), ("get_time", False)]
    raw = oai.responses.with_raw_response.create(model="m", input="hi", tools=[loose], tool_choice="none",
                                                 max_output_tokens=2).http_response.json()
    assert raw["tools"][0]["strict"] is True
