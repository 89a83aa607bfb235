"""Tools as real clients use them, against pagoda (random weights: tool_choice forces the call):
LangChain's ChatOpenAI.bind_tools and with_structured_output(method="function_calling"), and the
OpenAI Agents SDK running a two-turn agent over /v1/responses (a tool it must call, then an answer)."""
import asyncio
import json
from typing import Literal

import pytest

from tool_templates import tool_server

pytestmark = pytest.mark.timeout(300)
# a random model fills a free string until max_tokens: the arguments here are bounded
CITIES = ("Paris", "Köln", "東京")
CITY = Literal[CITIES]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with tool_server(tmp_path_factory, "qwen", num_kv_blocks=256) as s:
        yield s


def langchain_model(srv, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="m", base_url=srv.http_url + "/v1", api_key="none", max_retries=0, timeout=60,
                      max_completion_tokens=200, **kw)


def test_langchain_bind_tools(srv):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: CITY, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        """The weather in a city."""
        return "12"

    llm = langchain_model(srv, temperature=0.7).bind_tools([get_weather], tool_choice="get_weather",
                                                           parallel_tool_calls=False)
    msg = llm.invoke("Weather in Zürich?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITIES
    # the tool's result, and the next turn with the tools still bound (tool_choice none)
    from langchain_core.messages import HumanMessage, ToolMessage
    nxt = langchain_model(srv).bind_tools([get_weather], tool_choice="none").invoke(
        [HumanMessage("Weather in Zürich?"), msg, ToolMessage("12°C", tool_call_id=call["id"])])
    assert not nxt.tool_calls


def test_langchain_with_structured_output_function_calling(srv):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""
        name: str = Field(max_length=12)
        country: str = Field(pattern="^[A-Z]{2}$")
        population: int = Field(ge=0, le=10**9)

    out = langchain_model(srv, temperature=1.0).with_structured_output(
        City, method="function_calling", strict=True).invoke(  # strict: a closed object (a random model adds keys)
        "Name a city.")
    assert isinstance(out, City) and len(out.country) == 2


def test_agents_sdk_two_turn_agent(srv):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: CITY) -> str:
        """The weather in a city."""
        calls.append(city)
        return "12°C"

    client = AsyncOpenAI(base_url=srv.http_url + "/v1", api_key="none", max_retries=0)
    # after the call (tool_choice back to auto) the random model would babble until max_tokens: EOS pushed
    eos = {str(srv.engine.tokenizer.eos_token_id): 100}
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="m", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0.5,
                                               extra_body={"logit_bias": eos}),
                  reset_tool_choice=True)  # the SDK's default: after the call, tool_choice goes back to auto
    result = asyncio.run(Runner.run(agent, "Weather in Köln?", max_turns=4,
                                    run_config=RunConfig(model_settings=ModelSettings(max_tokens=200,
                                                                                      extra_body={"logit_bias": eos}))))
    assert len(calls) == 1 and calls[0] in CITIES
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", \
        [i.raw_item for i in result.new_items]
    assert json.loads(result.new_items[0].raw_item.arguments)["city"] == calls[0]
