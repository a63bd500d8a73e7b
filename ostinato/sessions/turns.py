"""Agent sessions as data: a `Session` is a chain of `Turn`s, each the messages sent, the
recorded assistant output and the kind of event that triggered it (sessions/read.py loads
them from files and splits them; the converters and the generator make them).

Storage is linear, not quadratic: a session keeps each conversation once and a turn is a
view (a shared list and how many of its messages were sent). Turns whose messages are not
an extension of the previous request start a new shared conversation, so hand-built or
truncated histories still round-trip exactly. `ostinato.session/1` JSONL is the format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

Message = dict[str, Any]
KINDS = ("first", "tool", "user")
FORMAT = "ostinato.session/1"


class SessionFormatError(ValueError):
    """A session spec, file or record that cannot be read; the message says what to pass."""


class Turn:
    """One request: the messages sent (the conversation so far) and the recorded output.

    kind is what triggered the request: "first" (the session's first request), "tool"
    (tool output; also an observation that an agent framework such as SWE-agent sends as a
    user message) or "user" (a user message). Pass `sent` to make the turn a view of the
    first `sent` messages of a shared list instead of owning `messages`.
    """

    __slots__ = ("_history", "_sent", "output", "kind")

    def __init__(self, messages: Sequence[Message], output: Message, kind: str,
                 sent: int | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"turn kind must be one of {KINDS}, got {kind!r}")
        self._history = messages
        self._sent = len(messages) if sent is None else sent
        if not 0 <= self._sent <= len(messages):
            raise ValueError(f"sent={sent} is outside a conversation of {len(messages)} messages")
        self.output = output
        self.kind = kind

    @property
    def messages(self) -> list[Message]:
        """The whole conversation sent with this request (a new list; dicts are shared)."""
        return list(self._history[: self._sent])

    @property
    def n_sent(self) -> int:
        return self._sent

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Turn):
            return NotImplemented
        return (self.kind, self._sent, self.output) == (other.kind, other._sent, other.output) \
            and self._history[: self._sent] == other._history[: other._sent]

    def __repr__(self) -> str:
        calls = len(self.output.get("tool_calls") or [])
        return f"Turn(kind={self.kind!r}, sent={self._sent} messages, output tool_calls={calls})"


@dataclass
class Session:
    """A recorded (or generated) agent session; `task` groups trials of one task."""

    id: str
    task: str
    source: str
    tools: list[dict] | None
    turns: list[Turn]

    def __post_init__(self) -> None:
        self.turns = _share_conversations(self.turns)

    @property
    def conversations(self) -> list[list[Message]]:
        """The distinct shared message lists behind the turns, in order (usually one)."""
        seen: dict[int, list[Message]] = {}
        for turn in self.turns:
            seen.setdefault(id(turn._history), turn._history)
        return list(seen.values())

    def new_messages(self, index: int) -> list[Message]:
        """Messages a prompt-caching engine has to prefill for turn `index`: everything
        after the previous request and its output (all messages for the first turn)."""
        turn = self.turns[index]
        if index == 0:
            return turn.messages
        prev = self.turns[index - 1]
        if prev._history is turn._history and prev._sent < turn._sent:
            start = prev._sent + 1
        else:
            start = _common_prefix(prev.messages + [prev.output], turn.messages)
        return list(turn._history[start: turn._sent])


def _common_prefix(a: Sequence[Message], b: Sequence[Message]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x is not y and x != y:
            break
        n += 1
    return n


def _share_conversations(turns: Iterable[Turn]) -> list[Turn]:
    """Re-point turns at shared lists: a turn that extends the previous request plus its
    output appends to the same list, any other turn starts a new list."""
    shared: list[Turn] = []
    history: list[Message] = []
    for turn in turns:
        sent = turn._history[: turn._sent]
        if not (len(history) <= len(sent) and sent[: len(history)] == history):
            history = []
        history.extend(sent[len(history):])
        history.append(turn.output)
        shared.append(Turn(history, turn.output, turn.kind, sent=len(sent)))
    return shared


def session_to_json(session: Session) -> dict:
    conversations = session.conversations
    index = {id(c): i for i, c in enumerate(conversations)}
    turns = []
    for turn in session.turns:
        record: dict[str, Any] = {"kind": turn.kind, "sent": turn.n_sent}
        if index[id(turn._history)]:
            record["conversation"] = index[id(turn._history)]
        turns.append(record)
    return {"format": FORMAT, "id": session.id, "task": session.task, "source": session.source,
            "tools": session.tools, "conversations": conversations, "turns": turns}


def session_from_json(record: dict) -> Session:
    if record.get("format") != FORMAT:
        raise SessionFormatError(f"not an {FORMAT} record (format={record.get('format')!r})")
    conversations = record["conversations"]
    turns = []
    for t in record["turns"]:
        history = conversations[t.get("conversation", 0)]
        turns.append(Turn(history, history[t["sent"]], t["kind"], sent=t["sent"]))
    return Session(str(record["id"]), str(record["task"]), str(record["source"]),
                   record.get("tools"), turns)


def write_jsonl(sessions: Iterable[Session], path: str | Path) -> None:
    """Write one session per line (UTF-8, no ASCII escaping)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for session in sessions:
            f.write(json.dumps(session_to_json(session), ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[Session]:
    sessions = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                sessions.append(session_from_json(json.loads(line)))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
                raise SessionFormatError(f"{path}:{lineno}: not a valid session line ({e})") from e
    return sessions
