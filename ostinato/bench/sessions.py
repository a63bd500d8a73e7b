"""Agent sessions: the unit that replays, routing profiles and dev/held-out splits use.

An agent session is a chain of requests. After every tool output or user message the
agent sends the whole conversation again (OpenAI chat messages) and gets one assistant
message back; an engine that keeps the previous request's KV cache prefills only the
newly appended messages. A `Session` is that chain as recorded: ordered `Turn`s, each
the messages sent, the recorded assistant output (which a replay forces, so every engine
prefills and decodes the same tokens) and the kind of event that triggered it.

Storage is linear, not quadratic: a session keeps each conversation once and a turn is a
view (a shared list and how many of its messages were sent). Turns whose messages are not
an extension of the previous request start a new shared conversation, so hand-built or
truncated histories still round-trip exactly.

Lengths in this package are measured in characters (about 4 characters per token for
English, JSON and code), so nothing here depends on a tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

Message = dict[str, Any]
KINDS = ("first", "tool", "user")
FORMAT = "ostinato.session/1"
SPEC_HELP = (
    "pass 'embedded' (or 'embedded:N' / 'embedded:N:SEED'), a sessions .jsonl, a tau2 "
    "results .json, a tau-bench trajectories .json, a SWE-agent .traj, or a folder of them"
)
EMBEDDED_SESSIONS = 30


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


def load_sessions(spec: str | Path) -> list[Session]:
    """Sessions from 'embedded[:N[:SEED]]', a file of any supported format, or a folder
    searched recursively (files of other formats in a folder are skipped)."""
    text = str(spec)
    if text == "embedded" or text.startswith("embedded:"):
        return _embedded(text)
    path = Path(text).expanduser()
    if path.is_dir():
        return _load_dir(path)
    if path.is_file():
        sessions = _load_file(path)
        if sessions is None:
            raise SessionFormatError(f"{path}: not a recognised session file; {SPEC_HELP}")
        return sessions
    raise SessionFormatError(f"no such file or directory: {text!r}; {SPEC_HELP}")


def _embedded(spec: str) -> list[Session]:
    from ostinato.bench.synthetic import generate_sessions

    parts = spec.split(":")[1:]
    try:
        n = int(parts[0]) if parts and parts[0] else EMBEDDED_SESSIONS
        seed = int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise SessionFormatError(f"bad embedded spec {spec!r}; {SPEC_HELP}") from None
    if len(parts) > 2 or n < 0:
        raise SessionFormatError(f"bad embedded spec {spec!r}; {SPEC_HELP}")
    return generate_sessions(n, seed)


def _load_dir(path: Path) -> list[Session]:
    sessions: list[Session] = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        if file.suffix in (".jsonl", ".json", ".traj"):
            sessions.extend(_load_file(file) or [])
    if not sessions:
        raise SessionFormatError(f"no session files found under {path}; {SPEC_HELP}")
    return sessions


def _load_file(path: Path) -> list[Session] | None:
    """Sessions of one file, or None when its content is not a known session format."""
    from ostinato.bench.converters import convert

    if path.suffix == ".jsonl":
        return read_jsonl(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SessionFormatError(f"{path}: not valid JSON ({e}); {SPEC_HELP}") from e
    return convert(data, path.stem)


def split_sessions(sessions: Sequence[Session], held_out_fraction: float = 0.5,
                   seed: int = 0) -> tuple[list[Session], list[Session]]:
    """Split into (dev, held_out) by task, never by turn or trial.

    Within each source the tasks are ranked by SHA-256 of (seed, source, task) and the
    first round(fraction * tasks) go to held-out, so every source contributes to both
    sides where it has two or more tasks. The split is the same in every process; a
    task's side depends only on the seed and the set of tasks of its source.
    """
    if not 0.0 <= held_out_fraction <= 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")
    tasks_by_source: dict[str, set[str]] = defaultdict(set)
    for s in sessions:
        tasks_by_source[s.source].add(s.task)
    held: set[tuple[str, str]] = set()
    for source, tasks in tasks_by_source.items():
        ranked = sorted(tasks, key=lambda task: _task_hash(seed, source, task))
        held.update((source, t) for t in ranked[: int(held_out_fraction * len(ranked) + 0.5)])
    dev = [s for s in sessions if (s.source, s.task) not in held]
    held_out = [s for s in sessions if (s.source, s.task) in held]
    return dev, held_out


def _task_hash(seed: int, source: str, task: str) -> str:
    return hashlib.sha256(f"{seed}\x1f{source}\x1f{task}".encode()).hexdigest()
