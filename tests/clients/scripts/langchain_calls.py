"""Run inside `.venv-langchain` by tests/clients/test_langchain.py: LangChain's OpenAI chat
model against a `tandem serve` at argv[1], printing one JSON object of what came back."""

import json
import sys
from typing import Literal

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel


class Trip(BaseModel):
    """A trip to plan."""

    city: Literal["Paris", "Oslo", "Lima"]
    by_train: bool


@tool
def book(city: Literal["Paris", "Oslo", "Lima"], by_train: bool) -> str:
    """Book a trip to a city."""
    return f"booked {city}"


llm = ChatOpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", model="tiny-moe", max_tokens=256, temperature=0)
question = "Plan a trip."
out = {}
structured = llm.with_structured_output(Trip, method="json_schema").invoke(question)
out["json_schema"] = structured.model_dump()
out["function_calling"] = llm.with_structured_output(Trip, method="function_calling").invoke(question).model_dump()
named = llm.bind_tools([book], tool_choice="book").invoke(question)
out["named"] = [{"name": c["name"], "args": c["args"]} for c in named.tool_calls]
required = llm.bind_tools([book], tool_choice="any").invoke(question)
out["required"] = [{"name": c["name"], "args": c["args"]} for c in required.tool_calls]
streamed = None
for chunk in llm.bind_tools([book], tool_choice="any").stream(question):
    streamed = chunk if streamed is None else streamed + chunk
out["required_streamed"] = [{"name": c["name"], "args": c["args"]} for c in streamed.tool_calls]
print(json.dumps(out))
