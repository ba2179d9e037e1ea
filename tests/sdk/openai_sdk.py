"""agentloop's OpenAI-compatible endpoints driven by the official `openai` Python package.

Env: AGENTLOOP_BASE (http://host:port/v1), AGENTLOOP_KEY, TRANSCRIPT (file for the streaming
transcript). Exits non-zero with the failing assertion; prints "N passed, 0 failed" at the end.
"""
import json
import os
import sys

import openai
from openai import OpenAI

BASE = os.environ["AGENTLOOP_BASE"]
client = OpenAI(base_url=BASE, api_key=os.environ["AGENTLOOP_KEY"], max_retries=0, timeout=60)
checks = []


def check(name, cond, detail=""):
    if not cond:
        print(f"FAILED {name}: {detail}", file=sys.stderr)
        sys.exit(1)
    checks.append(name)


def script(steps):
    return "MOCK: " + json.dumps({"steps": steps})


# Models.
models = client.models.list()
check("models.list", [m.id for m in models.data] == ["mock"] and models.data[0].object == "model", models)
check("models.retrieve", client.models.retrieve("mock").id == "mock")

# Non-streaming, with a server-side tool the caller never sees.
r = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "What is 6*7?"}])
check("non-stream content", r.choices[0].message.content == "The result is 42.", r)
check("non-stream finish", r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls, r)
check("non-stream usage", r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage)

# Streaming with usage; the transcript is kept for the report.
stream = client.chat.completions.create(
    model="mock",
    messages=[{"role": "user", "content": script([{"text": "one two three four five six seven eight nine ten", "chunkDelayMs": 150}])}],
    stream=True,
    stream_options={"include_usage": True},
)
chunks = list(stream)
with open(os.environ.get("TRANSCRIPT", "/dev/null"), "w") as f:
    for c in chunks:
        f.write(c.model_dump_json(exclude_none=True) + "\n")
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check("stream text", text == "one two three four five six seven eight nine ten", text)
check("stream pieces", sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1, len(chunks))
check("stream object", all(c.object == "chat.completion.chunk" for c in chunks))
check("stream finish", [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"])
check("stream usage", chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0, chunks[-1])

# Streaming through a server-side tool: only text reaches the caller.
chunks = list(client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "What is 12*7?"}], stream=True))
check("stream server tool hidden", all(not (c.choices and c.choices[0].delta.tool_calls) for c in chunks))
check("stream server tool text", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The result is 84.")

# Client-side tool round trip (non-streaming, then streaming).
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
messages = [{"role": "user", "content": script([{"text": "Checking.", "toolCalls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
                                                 {"text": "Weather in Paris: {{tool_result}}"}])}]
r1 = client.chat.completions.create(model="mock", messages=messages, tools=tools)
choice = r1.choices[0]
check("client tool finish", choice.finish_reason == "tool_calls", r1)
call = choice.message.tool_calls[0]
check("client tool call", call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}, call)
check("client tool text", choice.message.content == "Checking.", choice.message)
messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
r2 = client.chat.completions.create(model="mock", messages=messages, tools=tools)
check("client tool result used", r2.choices[0].message.content == "Weather in Paris: sunny, 21 C" and r2.choices[0].finish_reason == "stop", r2)
chunks = list(client.chat.completions.create(model="mock", messages=messages[:1], tools=tools, stream=True))
deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
check("stream client tool", len(deltas) == 1 and deltas[0].function.name == "get_weather" and deltas[0].id, deltas)
check("stream client finish", [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"])

# A client tool named like a server tool wins: the caller gets the call.
shadow = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
r = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "What is 2+3?"}], tools=shadow)
check("client shadows server", r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "calculator", r)

# Errors in OpenAI's shape.
def expect(exc_type, fn, code=None, param=None):
    try:
        fn()
    except exc_type as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(f"{exc_type.__name__} {code}", (code is None or body.get("code") == code) and (param is None or body.get("param") == param), body)
        return
    check(f"{exc_type.__name__} {code} raised", False, "no exception")

expect(openai.BadRequestError, lambda: client.chat.completions.create(model="mock", messages=[{"role": "wizard", "content": "x"}]), "invalid_messages", "messages[0].role")
expect(openai.BadRequestError, lambda: client.chat.completions.create(model="mock", messages=[]), "invalid_messages", "messages")
expect(openai.NotFoundError, lambda: client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}]), "model_not_found", "model")
expect(openai.BadRequestError, lambda: client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "x"}],
       tools=[{"type": "function", "function": {"name": "bad name"}}]), "invalid_tools", "tools[0].function.name")
expect(openai.NotFoundError, lambda: client.models.retrieve("nope"), "model_not_found")
expect(openai.InternalServerError, lambda: client.chat.completions.create(model="mock", messages=[{"role": "user", "content": script([{"status": 400}])}]), "model_http_error")
def failing_stream():
    for _ in client.chat.completions.create(model="mock", messages=[{"role": "user", "content": script([{"status": 400}])}], stream=True):
        pass
expect(openai.APIError, failing_stream, "model_http_error")
bad = OpenAI(base_url=BASE, api_key="al_0000000000000000000000000000000000000000", max_retries=0)
expect(openai.AuthenticationError, lambda: bad.chat.completions.create(model="mock", messages=[{"role": "user", "content": "x"}]), "invalid_api_key")
expect(openai.AuthenticationError, lambda: bad.models.list(), "invalid_api_key")

print(f"{len(checks)} passed, 0 failed")
