"""agentloop's MCP server (/mcp) driven by the official MCP Python SDK (`mcp` on PyPI).

Env: AGENTLOOP_MCP (http://host:port/mcp), AGENTLOOP_KEY, AGENTLOOP_OTHER_KEY (a second
principal), TRANSCRIPT (file for the session transcript). Prints "N passed, 0 failed".
"""
import asyncio
import json
import os
import sys
import uuid

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

URL = os.environ["AGENTLOOP_MCP"]
checks = []
log = []


def check(name, cond, detail=""):
    if not cond:
        print(f"FAILED {name}: {detail}", file=sys.stderr)
        sys.exit(1)
    checks.append(name)


async def session_for(key, body):
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        async with streamable_http_client(URL, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await body(session)


async def call(session, name, args):
    result = await session.call_tool(name, args)
    log.append({"call": name, "arguments": args, "isError": result.is_error, "result": result.structured_content})
    return result


async def first(session):
    tools = await session.list_tools()
    names = sorted(t.name for t in tools.tools)
    log.append({"tools/list": names})
    check("tools listed", names == sorted(["list_threads", "create_thread", "send_message", "get_run", "wait_run",
                                           "approve_tool_call", "reject_tool_call", "cancel_run"]), names)
    thread = (await call(session, "create_thread", {"title": "from the MCP Python SDK"})).structured_content
    command = str(uuid.uuid4())
    sent = (await call(session, "send_message", {"threadId": thread["id"], "content": "What is 6*7?", "commandId": command})).structured_content
    again = (await call(session, "send_message", {"threadId": thread["id"], "content": "What is 6*7?", "commandId": command})).structured_content
    check("send_message idempotent", sent["run"]["id"] == again["run"]["id"], (sent, again))
    waited = (await call(session, "wait_run", {"runId": sent["run"]["id"], "timeoutMs": 60000})).structured_content
    check("wait_run answer", waited["done"] and waited["status"] == "completed" and waited["answer"] == "The result is 42.", waited)
    got = (await call(session, "get_run", {"runId": sent["run"]["id"]})).structured_content
    check("get_run", got["status"] == "completed" and got["steps"], got)
    listed = (await call(session, "list_threads", {})).structured_content
    check("list_threads", [t["id"] for t in listed["threads"]] == [thread["id"]], listed)
    resources = await session.list_resources()
    check("resources listed", [str(r.uri) for r in resources.resources] == [f"agentloop://threads/{thread['id']}"], resources)
    window = await session.read_resource(f"agentloop://threads/{thread['id']}")
    body = json.loads(window.contents[0].text)
    log.append({"resources/read": f"agentloop://threads/{thread['id']}", "messages": [m["role"] for m in body["messages"]]})
    check("resource window", [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"], body)
    return thread["id"], sent["run"]["id"]


async def other(session, thread_id, run_id):
    listed = (await call(session, "list_threads", {})).structured_content
    check("other principal sees no thread", listed["threads"] == [], listed)
    for name, args in [("get_run", {"runId": run_id}), ("wait_run", {"runId": run_id, "timeoutMs": 10}),
                       ("cancel_run", {"runId": run_id}),
                       ("send_message", {"threadId": thread_id, "content": "hi", "commandId": str(uuid.uuid4())})]:
        r = await call(session, name, args)
        check(f"other principal {name} not found", r.is_error and r.structured_content["error"]["code"] == "not_found", r)
    try:
        await session.read_resource(f"agentloop://threads/{thread_id}")
        check("other principal resource not found", False, "read succeeded")
    except Exception as e:  # McpError: resource not found
        log.append({"resources/read (other principal)": str(e)})
        check("other principal resource not found", "no resource" in str(e), e)


async def main():
    thread_id, run_id = await session_for(os.environ["AGENTLOOP_KEY"], first)
    await session_for(os.environ["AGENTLOOP_OTHER_KEY"], lambda s: other(s, thread_id, run_id))
    with open(os.environ.get("TRANSCRIPT", "/dev/null"), "w") as f:
        for entry in log:
            f.write(json.dumps(entry) + "\n")
    print(f"{len(checks)} passed, 0 failed")


asyncio.run(main())
