"""The coding family (SWE-agent shape): a made-up Python repository with its commands,
file windows, search hits, tracebacks and test runs."""

from __future__ import annotations

import json
import random
from typing import Iterator

from ostinato.sessions.turns import Message
from ostinato.sessions.synthetic.common import _Built, _Lengths, _call, _fit, _lines, _prose


def _swe_session(rng: random.Random, lengths: _Lengths, family: str, spread: float) -> _Built:
    """A coding-agent session: function calling (observations as tool messages) in the
    measured share of sessions (chosen by `spread`), otherwise a command in the text and
    observations as user messages. Every request after the first answers an observation."""
    calling = spread < lengths.stats["tool_call_session_share"]
    repo = _Repo(rng)
    total = lengths.new("first")
    issue_len = round(total * rng.uniform(0.15, 0.35))
    conversation: list[Message] = [
        {"role": "system", "content": repo.system_prompt(rng, total - issue_len)},
        {"role": "user", "content": repo.issue(rng, issue_len)},
    ]
    turns = lengths.turns()
    requests = []
    for k in range(turns):
        if k:
            conversation.append(_swe_observation(rng, lengths, repo, conversation[-1], calling))
        requests.append(len(conversation))
        conversation.append(_swe_output(rng, lengths, repo, calling, final=k == turns - 1))
    return conversation, requests, ["first"] + ["tool"] * (turns - 1), _swe_schemas() if calling else None


def _swe_output(rng: random.Random, lengths: _Lengths, repo: _Repo, calling: bool, final: bool) -> Message:
    """Reasoning plus one command; the command takes part of the drawn length and the
    reasoning the rest."""
    size = lengths.output(calling)
    name, args, command = repo.command(rng, round(size * rng.uniform(0.2, 0.6)), final)
    if calling:
        arguments = json.dumps(args, separators=(",", ":"))
        thought = _prose(rng, repo, _SWE_THOUGHTS, max(size - len(name) - len(arguments) - 2, 20))
        return {"role": "assistant", "content": thought, "tool_calls": [_call(rng, name, arguments)]}
    thought = _prose(rng, repo, _SWE_THOUGHTS, max(size - len(command) - 9, 20))
    return {"role": "assistant", "content": f"{thought}\n```\n{command}\n```"}


def _swe_observation(rng: random.Random, lengths: _Lengths, repo: _Repo, last: Message, calling: bool) -> Message:
    text = repo.observation(rng, lengths.new("tool"))
    if not calling:
        return {"role": "user", "content": text}
    call = last["tool_calls"][0]
    return {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": text}


# Text material. Everything below is invented for this generator.

class _Repo:
    """A made-up Python repository: names for paths, functions, commands and outputs."""

    def __init__(self, rng: random.Random) -> None:
        self.pkg = rng.choice(("tidepool", "quillmark", "larkspur", "fennel", "cobalt", "wayfarer"))
        self.modules = rng.sample(_MODULES, 5)
        self.open_file = "n/a"

    def slots(self, rng: random.Random) -> dict:
        return {"path": self.path(rng), "func": _func_name(rng), "noun": rng.choice(_NOUNS),
                "n": rng.randint(3, 900), "error": rng.choice(_ERRORS), "pkg": self.pkg}

    def path(self, rng: random.Random) -> str:
        module = rng.choice(self.modules)
        return rng.choice((f"src/{self.pkg}/{module}.py", f"tests/test_{module}.py"))

    def command(self, rng: random.Random, size: int, final: bool) -> tuple[str, dict, str]:
        """(tool name, arguments, command line) of about `size` characters of call text."""
        if final:
            return "submit", {}, "submit"
        if size > 100 and rng.random() < 0.5:
            start = rng.randint(1, 400)
            code = _lines(rng, _code_lines(rng), size - 60)
            args = {"start_line": start, "end_line": start + rng.randint(0, 6), "replacement_text": code}
            return "edit", args, f"edit {start}:{args['end_line']}\n{code}\nend_of_edit"
        choices = [("open", {"path": self.path(rng), "line_number": rng.randint(1, 500)}),
                   ("search_dir", {"search_term": rng.choice(_NOUNS), "dir": f"src/{self.pkg}"}),
                   ("find_file", {"file_name": f"{rng.choice(self.modules)}.py", "dir": "src"}),
                   ("bash", {"command": rng.choice(_SHELL).format_map(self.slots(rng))}),
                   ("create", {"filename": "reproduce_bug.py"})]
        name, args = min(choices, key=lambda c: abs(len(c[0]) + len(json.dumps(c[1])) - size))
        line = args["command"] if name == "bash" else " ".join([name] + [str(v) for v in args.values()])
        return name, args, line

    def observation(self, rng: random.Random, size: int) -> str:
        """Tool output of about `size` characters: a file window, search hits, a traceback,
        a test run or a listing, with the shell's status footer."""
        kind = rng.choice(("view", "view", "search", "traceback", "tests", "listing"))
        if kind == "view":
            self.open_file = f"/repo/{self.path(rng)}"
        footer = f"\n(Open file: {self.open_file})\n(Current directory: /repo)\nbash-$"
        if size < len(footer) + 60:
            return min(_SHORT_OBSERVATIONS, key=lambda s: abs(len(s) - size))
        if kind == "view":
            first = rng.randint(1, 300)
            numbered = zip(range(first, first + 100_000), _code_lines(rng))
            head = f"[File: {self.open_file} ({first + rng.randint(100, 900)} lines total)]\n"
            body = _lines(rng, lambda r: "{}:{}".format(*next(numbered)), size - len(footer) - len(head))
            return head + body + footer
        head, tail = self._frame(rng, kind)
        body = _lines(rng, lambda r: self._output_line(r, kind), size - len(footer) - len(head) - len(tail))
        return head + body + tail + footer

    def _frame(self, rng: random.Random, kind: str) -> tuple[str, str]:
        term, n = rng.choice(_NOUNS), rng.randint(2, 60)
        if kind == "search":
            return (f'Found {n} matches for "{term}" in /repo/src/{self.pkg}:\n',
                    f'\nEnd of matches for "{term}" in /repo/src/{self.pkg}')
        if kind == "traceback":
            return "Traceback (most recent call last):\n", f"\n{rng.choice(_ERRORS)}: cannot parse {term}: None"
        if kind == "tests":
            return (f"==================== test session starts ====================\nplatform linux -- "
                    f"Python 3.11.9, pytest-8.2.1\nrootdir: /repo\ncollected {n * 7} items\n\n",
                    f"\n========== {n % 5 + 1} failed, {n * 6} passed in {rng.uniform(0.2, 9):.2f}s ==========")
        return f"total {n * 8}\n", ""

    def _output_line(self, rng: random.Random, kind: str) -> str:
        path, func = self.path(rng), _func_name(rng)
        if kind == "search":
            return f"/repo/{path}:{rng.randint(1, 900)}:{_code_line(rng).strip()}"
        if kind == "traceback":
            return f'  File "/repo/{path}", line {rng.randint(1, 900)}, in {func}\n    {_code_line(rng).strip()}'
        if kind == "tests":
            marks = "".join(rng.choice("....F.s") for _ in range(rng.randint(5, 40)))
            return f"{path} {marks} [{rng.randint(1, 100):3d}%]"
        return f"-rw-r--r-- 1 root root {rng.randint(80, 90000):6d} Mar {rng.randint(1, 28):2d} {path}"

    def system_prompt(self, rng: random.Random, size: int) -> str:
        head = ("You are an autonomous software engineer working in a terminal on a Python repository. "
                "Each reply states your reasoning and then exactly one command; wait for its output "
                "before the next one. Interactive programs (editors, REPLs) are not available.\n\n"
                "COMMANDS:\n" + "\n".join(f"{name}: {doc}" for name, doc, _ in _SWE_TOOLS) +
                "\n\nAn example of an earlier session follows.\n")
        return _fit(head + _lines(rng, self._example(rng), size - len(head)), size)

    def _example(self, rng: random.Random) -> Iterator[str]:
        """An endless demonstration: reasoning, a command, and the file window it shows."""
        code = _code_lines(rng)
        while True:
            yield "\n" + _prose(rng, self, _SWE_THOUGHTS, rng.randint(60, 220))
            path, first = self.path(rng), rng.randint(1, 400)
            yield f"```\nopen {path} {first}\n```\n[File: /repo/{path}]"
            yield from (f"{first + i}:{next(code)}" for i in range(rng.randint(5, 30)))

    def issue(self, rng: random.Random, size: int) -> str:
        func, error = _func_name(rng), rng.choice(_ERRORS)
        head = (f"Please fix the following issue in the {self.pkg} repository.\nISSUE:\n{func} raises "
                f"{error} for empty input\n\nCalling `{func}` on an empty {rng.choice(_NOUNS)} fails:\n\n```python\n")
        tail = (f"\n```\n\nINSTRUCTIONS:\nReproduce the bug first, then change the code under src/{self.pkg}, "
                "run the tests and submit when they pass.")
        return _fit(head + _lines(rng, _code_lines(rng), size - len(head) - len(tail)) + tail, size)


def _swe_schemas() -> list[dict]:
    def prop(arg: str) -> dict:
        return {"type": "integer" if arg in ("line_number", "start_line", "end_line") else "string"}

    return [{"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "properties": {a: prop(a) for a in args}, "required": list(args)}}}
        for name, doc, args in _SWE_TOOLS]


_SWE_TOOLS = (
    ("open", "show 100 lines of a file around a line number", ("path", "line_number")),
    ("edit", "replace lines start_line..end_line of the open file with new text", ("start_line", "end_line",
                                                                                    "replacement_text")),
    ("search_dir", "list the files under a folder that contain a term", ("search_term", "dir")),
    ("find_file", "find files by name under a folder", ("file_name", "dir")),
    ("create", "create an empty file and open it", ("filename",)),
    ("bash", "run a shell command and show its output", ("command",)),
    ("submit", "submit the current changes as the solution", ()),
)
_MODULES = ("fields", "schema", "utils", "parser", "io", "cache", "registry", "formats", "decorators",
            "validate", "compat", "timing")
_NOUNS = ("value", "field", "schema", "record", "token", "buffer", "offset", "config", "precision",
          "timestamp", "payload", "context", "options", "result")
_VERBS = ("load", "parse", "serialize", "validate", "resolve", "render", "merge", "compute", "encode", "build")
_ERRORS = ("ValueError", "TypeError", "KeyError", "AttributeError", "IndexError", "AssertionError")
_SHELL = ("python reproduce_bug.py", "python -m pytest tests/test_{noun}.py -x -q", "ls src/{pkg}",
          "grep -rn \"{func}\" src/{pkg}", "git diff", "python -c \"import {pkg}; print({pkg}.__version__)\"")
_SHORT_OBSERVATIONS = ("", "File updated.", "Your command ran successfully and did not produce any output.",
                       "No matches found.", "[File: /repo/reproduce_bug.py (1 lines total)]\n1:")
_SWE_THOUGHTS = (
    "Let's open {path} and see how {func} handles the {noun}.", "The traceback points at {func} in {path}.",
    "Now let's run the reproduction script again to check the fix.",
    "The {error} comes from the {noun} being None when the input is empty.",
    "We should search the package for other callers of {func} before changing it.",
    "The edit looks right; the indentation matches the surrounding block.",
    "Line {n} converts the {noun} before checking it, which is the bug.",
    "Let's write a small script that reproduces the {error}.",
    "All tests pass now, so the change can be submitted.",
)
_STATEMENTS = (
    "    if {a} is None:\n        return {default}", "    {b} = self._{a}s.get({a}, {default})",
    "    for item in {b} or ():\n        {a} = {verb}_{b}(item, {a})",
    "    if not isinstance({a}, {type}):\n        raise {error}(f\"cannot {verb} {a}: {{{a}!r}}\")",
    "    result = [{verb}_{a}(x) for x in {b}]", "    {a} = int(round({a} / {b}))",
    "    # {Verb} before the {b} is checked, so that a missing {a} fails early.",
    "    {b}.update({a}={a}, strict=strict)",
)


def _code_lines(rng: random.Random) -> Iterator[str]:
    """An endless module: imports, then functions with docstrings and small bodies."""
    for module in rng.sample(("json", "math", "typing", "datetime", "decimal", "functools"), 3):
        yield f"import {module}"
    while True:
        a, b, verb = rng.choice(_NOUNS), rng.choice(_NOUNS), rng.choice(_VERBS)
        names = {"a": a, "b": b, "verb": verb, "Verb": verb.title(), "error": rng.choice(_ERRORS),
                 "default": rng.choice(("None", "0", "{}", "()", '""')),
                 "type": rng.choice(("int", "str", "dict", "float"))}
        yield ""
        yield f"def {verb}_{a}({a}, {b}=None, strict=False):"
        yield f'    """{verb.title()} the {a} of a {b}; raise {names["error"]} when strict and it is invalid."""'
        for _ in range(rng.randint(2, 6)):
            yield from rng.choice(_STATEMENTS).format_map(names).split("\n")
        yield f"    return {a}"


def _func_name(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _code_line(rng: random.Random) -> str:
    """One statement-like line, for search hits and traceback frames."""
    lines = _code_lines(rng)
    return next(line for line in lines if line.startswith("    ") and rng.random() < 0.3).strip()
