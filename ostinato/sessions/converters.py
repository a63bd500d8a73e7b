"""Recorded agent runs (tau2, tau-bench, SWE-agent) -> `Session`s.

Each source stores a conversation differently; all become one request per generated
assistant message: the messages before it are sent, the message is the output. Content
becomes plain strings, tool calls become OpenAI `{"id", "type", "function": {"name",
"arguments": <JSON string>}}` with ids kept (or invented deterministically) and tool
messages answer them by `tool_call_id`. Tool schemas are missing from the recordings, so
they are inferred from the names, argument keys and value types of the recorded calls of
a file; they lack descriptions and are therefore shorter than the ones the agent saw.

Task ids group what must land on one side of a dev/held-out split: tau2 and tau-bench
tasks per domain (across agent models and trials), SWE-agent runs by their issue text
(the eight marshmallow-1867 variants are one task).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Iterable

from ostinato.sessions.turns import Message, Session, Turn

TAU2_INSTRUCTIONS = (
    "You are a customer service agent. Help the user by following the policy below, "
    "use the tools when you need data or to make a change, and make one tool call or "
    "send one message to the user at a time."
)


def convert(data: Any, name: str) -> list[Session] | None:
    """Sessions from the parsed JSON of one file (its stem is `name`), or None if the
    content is not a format this module knows."""
    converter = detect_format(data)
    return None if converter is None else converter(data, name)


def detect_format(data: Any) -> Callable[[Any, str], list[Session]] | None:
    if isinstance(data, dict) and "simulations" in data and "tasks" in data:
        return convert_tau2
    if isinstance(data, dict) and ("history" in data or "trajectory" in data):
        return convert_swe_agent
    if isinstance(data, list) and data and all(isinstance(e, dict) and "traj" in e for e in data):
        return convert_tau_bench
    return None


def text_of(content: Any) -> str:
    """Message content as one string: lists of content parts are joined by their text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(text_of(p.get("text", p.get("content")) if isinstance(p, dict) else p)
                       for p in content)
    return json.dumps(content, ensure_ascii=False)


def tool_call(call_id: str | None, name: str, arguments: Any) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def message(role: str, content: Any, **extra: Any) -> Message:
    msg: Message = {"role": role, "content": text_of(content)}
    msg.update({k: v for k, v in extra.items() if v})
    return msg


def link_tool_calls(messages: list[Message], prefix: str) -> list[Message]:
    """Give every tool call an id (`{prefix}_{message}_{call}` if missing) and every tool
    message the id and name of the call it answers (the oldest unanswered one if unknown)."""
    names: dict[str, str] = {}
    pending: list[str] = []
    for i, msg in enumerate(messages):
        for j, call in enumerate(msg.get("tool_calls") or []):
            call["id"] = call.get("id") or f"{prefix}_{i}_{j}"
            names[call["id"]] = call["function"]["name"]
            pending.append(call["id"])
        if msg["role"] == "tool":
            call_id = msg.get("tool_call_id") or (pending[0] if pending else f"{prefix}_{i}_orphan")
            msg["tool_call_id"] = call_id
            if call_id in pending:
                pending.remove(call_id)
            if not msg.get("name") and call_id in names:
                msg["name"] = names[call_id]
    return messages


def build_session(session_id: str, task: str, source: str, tools: list[dict] | None,
                  messages: list[Message], requests: Iterable[int],
                  kind_of: Callable[[int], str] | None = None) -> Session:
    """One turn per index in `requests` (an assistant message): sent = messages before it."""
    turns = []
    for i in requests:
        if not turns:
            kind = "first"
        elif kind_of is not None:
            kind = kind_of(i)
        else:
            kind = "tool" if messages[i - 1]["role"] == "tool" else "user"
        turns.append(Turn(messages, messages[i], kind, sent=i))
    return Session(session_id, task, source, tools, turns)


def assistant_indices(messages: list[Message]) -> list[int]:
    """Assistant messages that answer something: a fixed greeting before any user
    message (tau2 starts that way) is part of the prompt, not a request."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > first_user]


def convert_tau2(data: dict, name: str) -> list[Session]:
    env = data["info"]["environment_info"]
    domain = env.get("domain_name") or name
    system = message("system", f"{TAU2_INSTRUCTIONS}\n\n<policy>\n{env.get('policy', '')}\n</policy>")
    conversations = []
    for sim in data["simulations"]:
        messages = [system] + [m for raw in sim["messages"] if (m := _tau2_message(raw))]
        conversations.append((sim, link_tool_calls(messages, f"call_{sim.get('id', '')[:8]}")))
    tools = infer_tool_schemas(m for _, ms in conversations for m in ms)
    sessions = []
    for sim, messages in conversations:
        task, trial = str(sim["task_id"]), sim.get("trial", 0)
        sessions.append(build_session(f"tau2/{name}/{task}/{trial}", task, f"tau2/{domain}",
                                      tools, messages, assistant_indices(messages)))
    return sessions


def _tau2_message(raw: dict) -> Message | None:
    """The agent's view of one tau2 message; the user simulator's own tool calls (telecom)
    and their results never reach the agent."""
    role = raw["role"]
    if role == "user" and raw.get("tool_calls") or role == "tool" and raw.get("requestor") == "user":
        return None
    if role == "tool":
        return message("tool", raw.get("content"), tool_call_id=raw.get("id"))
    if role != "assistant" or not raw.get("tool_calls"):
        return message(role, raw.get("content"))
    raw_calls = ((raw.get("raw_data") or {}).get("message") or {}).get("tool_calls") or []
    generated = {c.get("id"): c["function"]["arguments"] for c in raw_calls if "function" in c}
    calls = [tool_call(c.get("id"), c["name"], generated.get(c.get("id"), c.get("arguments") or {}))
             for c in raw["tool_calls"]]
    return message("assistant", raw.get("content"), tool_calls=calls)


def convert_tau_bench(data: list, name: str) -> list[Session]:
    domain = name.rsplit("-", 1)[-1]
    conversations = []
    for n, entry in enumerate(data):
        messages = [_openai_message(m) for m in entry["traj"]]
        conversations.append((entry, link_tool_calls(messages, f"call_tb{n}")))
    tools = infer_tool_schemas(m for _, ms in conversations for m in ms)
    sessions = []
    for entry, messages in conversations:
        task, trial = str(entry["task_id"]), entry.get("trial", 0)
        sessions.append(build_session(f"tau-bench/{name}/{task}/{trial}", task,
                                      f"tau-bench/{domain}", tools, messages,
                                      assistant_indices(messages)))
    return sessions


def _openai_message(raw: dict) -> Message:
    calls = [tool_call(c.get("id"), c["function"]["name"], c["function"].get("arguments", "{}"))
             for c in raw.get("tool_calls") or []]
    call_id = raw.get("tool_call_id") or (raw.get("tool_call_ids") or [None])[0]
    return message(raw["role"], raw.get("content"), tool_calls=calls, tool_call_id=call_id,
                   name=raw.get("name") if raw["role"] == "tool" else None)


def convert_swe_agent(data: dict, name: str) -> list[Session]:
    """Every request after the first answers an observation (tool output), whether the
    run sent it as a tool message (function calling) or as a user message."""
    messages = _swe_history(data)
    link_tool_calls(messages, f"call_{name[:16]}")
    tools = infer_tool_schemas(messages) or None
    requests = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [build_session(f"swe-agent/{name}", _swe_task(messages), "swe-agent", tools,
                          messages, requests, kind_of=lambda i: "tool")]


def _swe_history(data: dict) -> list[Message]:
    history = data.get("history") or []
    if history:
        agent = history[0].get("agent")
        return [_openai_message(m) for m in history if m.get("agent") == agent]
    # a run saved without history: rebuild the exchange from its steps; the task
    # statement is not in the steps, so a placeholder stands in for it
    messages = [message("user", "(task statement not recorded in this trajectory)")]
    for step in data.get("trajectory") or []:
        messages.append(message("assistant", step.get("response")))
        messages.append(message("user", step.get("observation")))
    return messages


def _swe_task(messages: list[Message]) -> str:
    """The task is the issue (or challenge) text of the first non-demonstration user
    message; the surrounding instance template differs between agent configurations."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    text = next((u for u in users if not u.startswith("Here is a demonstration")), users[0] if users else "")
    found = re.search(r"ISSUE:\n(.*?)\n\s*INSTRUCTIONS:", text, re.S)
    issue = (found.group(1) if found else text).replace("\r\n", "\n").strip()
    return "issue-" + hashlib.sha256(issue.encode()).hexdigest()[:12]


def infer_tool_schemas(messages: Iterable[Message]) -> list[dict]:
    """OpenAI tool schemas, sorted by name, from the recorded calls: one property per
    argument key seen, typed from its values; keys present in every call are required."""
    calls: dict[str, list[dict]] = {}
    for msg in messages:
        for call in msg.get("tool_calls") or []:
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
            except json.JSONDecodeError:
                args = {}
            calls.setdefault(call["function"]["name"], []).append(args if isinstance(args, dict) else {})
    return [{"type": "function", "function": {"name": name, "parameters": _object_schema(seen)}}
            for name, seen in sorted(calls.items())]


def _object_schema(objects: list[dict]) -> dict:
    keys = list(dict.fromkeys(k for o in objects for k in o))
    properties = {k: _value_schema([o[k] for o in objects if k in o]) for k in keys}
    required = [k for k in keys if all(k in o for o in objects)]
    return {"type": "object", "properties": properties, "required": required}


def _value_schema(values: list[Any]) -> dict:
    types = list(dict.fromkeys(_json_type(v) for v in values))
    if set(types) == {"integer", "number"}:
        types = ["number"]
    if types == ["object"]:
        return _object_schema(values)
    if types == ["array"]:
        items = [x for v in values for x in v]
        return {"type": "array", "items": _value_schema(items)} if items else {"type": "array"}
    return {"type": types[0] if len(types) == 1 else types}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "null" if value is None else "string"
