"""The text inside sessions, for measuring lengths and for training a tokenizer.

A message's text is what a chat template renders from it besides the framing: its
content and, for each tool call, the name and the JSON arguments. Lengths are counted in
characters (about 4 per token), so statistics need no tokenizer.
"""

from __future__ import annotations

import json
from typing import Iterable, Iterator

from ostinato.sessions.turns import Message, Session


def message_text(message: Message) -> str:
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        parts.append(call["function"]["name"])
        parts.append(call["function"]["arguments"])
    return "\n".join(p for p in parts if p)


def message_chars(message: Message) -> int:
    return len(message_text(message))


def messages_chars(messages: Iterable[Message]) -> int:
    return sum(message_chars(m) for m in messages)


def tool_call_json(call: dict) -> str:
    """A tool call as templates usually render it: {"name": ..., "arguments": {...}}."""
    arguments = call["function"]["arguments"]
    try:
        arguments = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        pass
    return json.dumps({"name": call["function"]["name"], "arguments": arguments}, ensure_ascii=False)


def session_texts(sessions: Iterable[Session]) -> Iterator[str]:
    """Every text of every session once: the tool schemas (JSON), then each message's
    content and tool calls (JSON), each shared conversation walked once."""
    for session in sessions:
        if session.tools:
            yield json.dumps(session.tools, ensure_ascii=False)
        for conversation in session.conversations:
            for msg in conversation:
                if msg.get("content"):
                    yield msg["content"]
                for call in msg.get("tool_calls") or []:
                    yield tool_call_json(call)
