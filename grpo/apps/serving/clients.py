"""A calculator agent on `grpo serve` through the clients people deploy with: the plain
`openai` loop, the OpenAI Agents SDK's `Runner`, and LangChain's `bind_tools`. Each runs one
problem's episode greedily, as its users write it (the code docs/serving.md shows), and
records the requests it sent, so a test or a benchmark can evaluate the model on exactly the
tool schema the client generated (`sent_tools`).

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", http_client=recorder.client())
    episode = openai_episode(client, "agent", "What is 37 * 48?", [CALCULATOR_TOOL])

The tool each client calls is `calculate` (the `calculator` environment's own evaluation), and
its docstring, which the Agents SDK and LangChain turn into the schema's description, is not
one of the renderings a model is trained on (`grpo.envs.calculator.calculator_tool_variant`).
The client packages are imported only by the function that uses them (`pip install
"grpo[clients]"`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from grpo.envs.calculator import run_tool_call
from grpo.envs.tool_calls import ToolCall


def calculate(expression: str) -> str:
    """Work out an arithmetic expression exactly and give back the number.

    Args:
        expression: The arithmetic to work out, such as 6 * 7.
    """
    return run_tool_call(ToolCall("calculator", {"expression": expression}))[0]


@dataclass
class Episode:
    """One problem through a client: the final message's content ("" when the turn limit
    came first), the tool calls the client ran, and the model turns (requests)."""

    content: str
    calls: int
    turns: int


@dataclass
class Recorder:
    """The JSON bodies of the requests a client sends (an httpx request hook)."""

    bodies: list[dict] = field(default_factory=list)

    def _record(self, request) -> None:
        if request.method == "POST" and request.content:
            self.bodies.append(json.loads(request.content))

    async def _arecord(self, request) -> None:
        self._record(request)

    def client(self):
        """An `httpx.Client` that records (for `openai.OpenAI`, `ChatOpenAI`)."""
        import httpx

        return httpx.Client(event_hooks={"request": [self._record]}, timeout=120)

    def async_client(self):
        """An `httpx.AsyncClient` that records (for `openai.AsyncOpenAI`)."""
        import httpx

        return httpx.AsyncClient(event_hooks={"request": [self._arecord]}, timeout=120)

    def sent_tools(self) -> list[dict]:
        """The `tools` of the last request that had them (what the client generated)."""
        for body in reversed(self.bodies):
            if body.get("tools"):
                return body["tools"]
        raise ValueError("no request with tools was recorded")


def openai_episode(
    client,
    model: str,
    question: str,
    tools: list[dict],
    *,
    max_turns: int = 3,
    max_tokens: int = 32,
) -> Episode:
    """The agent loop written with the plain `openai` client: ask with the tools; while the
    model answers with tool calls, run them and send the results back; at most `max_turns`
    model turns."""
    messages: list[dict] = [{"role": "user", "content": question}]
    calls = 0
    for turn in range(1, max_turns + 1):
        r = client.chat.completions.create(
            model=model, messages=messages, tools=tools, temperature=0, max_tokens=max_tokens
        )
        msg = r.choices[0].message
        if not msg.tool_calls:
            return Episode(msg.content or "", calls, turn)
        messages.append(msg.model_dump())  # echoed back as the client returned it
        for tc in msg.tool_calls:
            calls += 1
            args = json.loads(tc.function.arguments)
            result = run_tool_call(ToolCall(tc.function.name, args))[0]
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
    return Episode("", calls, max_turns)


def agents_sdk_episodes(
    base_url: str,
    model: str,
    questions: list[str],
    *,
    recorder: Recorder | None = None,
    max_turns: int = 3,
    max_tokens: int = 32,
) -> list[Episode]:
    """Each question through the OpenAI Agents SDK: an `Agent` with `calculate` as a
    `@function_tool` (the SDK sends a ``strict`` schema with ``additionalProperties: false``),
    an `OpenAIChatCompletionsModel` on the server, `Runner.run`, tracing off."""
    import asyncio
    import functools
    import os

    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    calls = [0]

    @functools.wraps(calculate)
    def counted(expression: str) -> str:
        calls[0] += 1
        return calculate(expression)

    async def run_all() -> list[Episode]:
        http = recorder.async_client() if recorder else None
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
        agent = Agent(
            name="calculator agent",
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
            tools=[function_tool(counted, name_override="calculator")],
            model_settings=ModelSettings(temperature=0, max_tokens=max_tokens),
        )
        out = []
        for question in questions:
            calls[0] = 0
            try:
                result = await Runner.run(agent, question, max_turns=max_turns)
            except MaxTurnsExceeded:  # the turn limit: no final answer
                out.append(Episode("", calls[0], max_turns))
                continue
            out.append(Episode(str(result.final_output or ""), calls[0], len(result.raw_responses)))
        await client.close()
        return out

    return asyncio.run(run_all())


def langchain_episode(llm, question: str, *, max_turns: int = 3) -> Episode:
    """One question through LangChain: `llm` is ``ChatOpenAI(...).bind_tools([tool])`` (see
    `langchain_model`); invoke, run each tool call, send `ToolMessage`s back."""
    from langchain_core.messages import HumanMessage, ToolMessage

    messages: list = [HumanMessage(question)]
    calls = 0
    for turn in range(1, max_turns + 1):
        ai = llm.invoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            return Episode(ai.content if isinstance(ai.content, str) else "", calls, turn)
        for tc in ai.tool_calls:
            calls += 1
            result = run_tool_call(ToolCall(tc["name"], tc["args"]))[0]
            messages.append(ToolMessage(result, tool_call_id=tc["id"]))
    return Episode("", calls, max_turns)


def langchain_model(
    base_url: str, model: str, *, recorder: Recorder | None = None, max_tokens: int = 32
):
    """``ChatOpenAI(base_url=...)`` on the server, greedy, with `calculate` bound as the
    LangChain tool ``calculator`` (`bind_tools`)."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=model,
        base_url=base_url,
        api_key="unused",
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        http_client=recorder.client() if recorder else None,
    )
    return llm.bind_tools([tool("calculator")(calculate)])
