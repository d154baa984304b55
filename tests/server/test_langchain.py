"""LangChain's ChatOpenAI against a live kvpage server: `with_structured_output` (a pydantic model, by the JSON
schema method: response_format) and `bind_tools` (a tool call back, with tool_choice naming the tool)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import assert_pool_free

langchain_openai = pytest.importorskip("langchain_openai")
pytest.importorskip("xgrammar")


class City(BaseModel):
    """A city and its country."""

    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


def _chat(server, **kw):
    return langchain_openai.ChatOpenAI(model="smollm2", base_url=server.base_url, api_key="unused", temperature=0,
                                       max_retries=0, **kw)  # fmt: skip


def test_with_structured_output(server):
    llm = _chat(server, max_tokens=60).with_structured_output(City, method="json_schema")
    got = llm.invoke("Give the largest city of France and its country.")
    assert isinstance(got, City) and got.city and got.country
    assert_pool_free(server)


def test_bind_tools(server):
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "sunny"

    llm = _chat(server, max_tokens=60).bind_tools([get_weather], tool_choice="get_weather")
    msg = llm.invoke("What is the weather like in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"]
    assert_pool_free(server)
