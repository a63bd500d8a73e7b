"""The replay client: recorded sessions, turn by turn, against an engine, timed at the client.

Each turn is one request: the conversation so far (the turn's messages and the session's
tools) and the recorded assistant output, which every engine must emit exactly, so all
engines prefill and decode the same tokens. Two targets:

* `InProcessTarget`: the engine in this process. prompt = render_ids(turn.messages, tools),
  forced = encode(render_assistant_output(turn.output, tools)); the placement counters are
  read before the request, at its first token and at its end (prefill and decode deltas).
* `HttpTarget`: any OpenAI-compatible endpoint, streaming. Ours gets the recorded output
  in the forced-output field (FORCED_OUTPUT_FIELD, ids for token prompts); any other
  engine gets max_tokens = the recorded length and `ignore_eos` (llama.cpp's and vLLM's
  name), so it decodes as many tokens. Engine figures come from the final chunk's
  `timings` (llama.cpp's fields, which ours also sends) and `usage`; ours also exposes
  its placement counters on /metrics, read before and after each request.

The session slot is not reset between sessions (a server would not be either): a new
session reuses whatever prefix it shares with the previous one, on every target alike.
A session stops at its first failed turn (an error, or a turn that does not fit the
context), and the rest of it is not sent.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ostinato.bench.metrics import TurnResult, client_timing, placement_delta
from ostinato.config import ConfigError

FORCED_OUTPUT_FIELD = "ostinato_forced_output"  # ostinato/server/protocol.py: the assistant message to emit
FORCED_IDS_FIELD = "ostinato_forced_ids"  # the same as token ids (chat and completions)
CHARS_PER_TOKEN = 4  # output length estimate for engines replayed without a tokenizer


@dataclass
class TurnRequest:
    session: str
    turn: int  # index in the session (a sweep point: its requested new tokens)
    kind: str
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    output: dict | None = None  # the recorded assistant message
    prompt_ids: list[int] | None = None  # when known (in-process, sweeps); else rendered by the target
    forced_ids: list[int] | None = None
    max_output: int | None = None  # the recorded output is cut after this many tokens


def session_requests(session, tokenizer=None, max_output: int | None = None) -> list[TurnRequest]:
    """The requests of a session; with a tokenizer, also their prompt and forced ids. With
    max_output, each turn emits at most that many of its recorded tokens (the next turn's
    prompt still holds the whole recorded message, so it prefills the rest)."""
    tools = session.tools or None
    out = []
    for i, turn in enumerate(session.turns):
        req = TurnRequest(session.id, i, turn.kind, turn.messages, tools, turn.output, max_output=max_output)
        if tokenizer is not None:
            req.prompt_ids = tokenizer.render_ids(turn.messages, tools)
            req.forced_ids = tokenizer.encode(tokenizer.render_assistant_output(turn.output, tools))[:max_output]
        out.append(req)
    return out


class InProcessTarget:
    """Engine.generate in this process; clock() gives the client's times."""

    def __init__(self, loaded, clock: Callable[[], float] = time.perf_counter):
        self.loaded = loaded
        self.clock = clock
        self.name = "in-process"

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_context(self) -> int:
        return self.loaded.engine.max_context

    def run(self, req: TurnRequest) -> TurnResult:
        from ostinato.engine.sampling import SamplingParams
        from ostinato.engine.session import GenerationStats

        tok, engine, runner = self.loaded.tokenizer, self.loaded.engine, self.loaded.runner
        prompt = req.prompt_ids if req.prompt_ids is not None else tok.render_ids(req.messages, req.tools)
        forced = req.forced_ids if req.forced_ids is not None else \
            tok.encode(tok.render_assistant_output(req.output, req.tools))
        res = TurnResult(req.session, req.turn, req.kind, prompt_tokens=len(prompt))
        if len(prompt) + len(forced) > engine.max_context:
            res.error = (f"context: {len(prompt)} prompt + {len(forced)} output tokens exceed the engine's "
                         f"{engine.max_context}")
            return res
        stats = GenerationStats()
        p0 = runner.placement_stats()
        p1 = None
        first = last = None
        n = 0
        sent = self.clock()
        try:
            for _ in engine.generate(prompt, SamplingParams(max_tokens=len(forced)), forced=forced, stats=stats):
                last = self.clock()
                n += 1
                if first is None:
                    first = last
                    p1 = runner.placement_stats()
        except Exception as e:  # noqa: BLE001 - a failed turn is a result, the replay goes on
            res.error = f"{type(e).__name__}: {e}"
        p2 = runner.placement_stats()
        res.ttft_s, res.tpot_s, res.request_s = client_timing(sent, first, last, n)
        res.output_tokens, res.cached_tokens = n, stats.cached_tokens
        res.prefill_s, res.decode_s = stats.prefill_s, stats.decode_s
        if p2:
            p1 = p1 if p1 is not None else p2
            res.placement = {"prefill": placement_delta(p0, p1), "decode": placement_delta(p1, p2)}
        return res


class HttpTarget:
    """An OpenAI-compatible endpoint. kind: 'ostinato' (forced outputs, /metrics placement),
    'openai' (max_tokens + ignore_eos; the prompt as our tokenizer's ids on /v1/completions when the
    replay has a tokenizer, else as chat messages), or 'auto' (ours if /v1/models says owned_by
    ostinato).
    first_token: 'chunk' (the first streamed chunk: our server opens the stream with the first
    token) or 'text' (the first chunk that carries text, for servers that send a role chunk
    before prefilling)."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.perf_counter, kind: str = "auto",
                 tokenizer=None, api_key: str | None = None, model: str | None = None, timeout: float = 900.0,
                 first_token: str = "chunk", transport=None, api: str = "openai", hold_outputs: bool = True):
        """api: 'openai' (chat completions) or 'anthropic' (/v1/messages; our server, forced ids from
        `tokenizer`, so both routes replay the same tokens). hold_outputs: see hold_output."""
        import httpx

        if api not in ("openai", "anthropic"):
            raise ConfigError(f"api {api!r}: give openai or anthropic")
        if api == "anthropic" and tokenizer is None:
            raise ConfigError("a replay through /v1/messages needs --tokenizer (its forced outputs are token ids)")
        self.api = api

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout, headers=headers, transport=transport)
        self.clock, self.tokenizer, self.first_token = clock, tokenizer, first_token
        self.url = url
        self.kind, self.model = kind, model
        self.hold_outputs = hold_outputs
        self.held = {"turns": 0, "tokens": 0, "failed": 0}  # hold_output's requests
        self.max_context = None
        if kind == "auto" or model is None:
            self._detect()
        if api == "anthropic" and not self.forced:
            raise ConfigError(f"{url}: a replay through /v1/messages forces the recorded outputs, which only "
                              "Ostinato's server takes")
        self.name = f"{self.kind}@{url}"

    @property
    def forced(self) -> bool:
        """The engine takes the recorded outputs (Ostinato's server); any other generates its own, with
        max_tokens and ignore_eos, and holds the recorded answer between turns (hold_output)."""
        return self.kind == "ostinato"

    def _detect(self) -> None:
        r = self.client.get("/v1/models")
        r.raise_for_status()
        cards = r.json().get("data") or [{}]
        card = cards[0]
        self.model = self.model or card.get("id")
        self.max_context = card.get("max_model_len")
        if self.kind == "auto":
            self.kind = "ostinato" if card.get("owned_by") == "ostinato" else "openai"

    def close(self) -> None:
        self.client.close()

    def placement(self) -> dict[str, float]:
        """Our server's placement counters (the ostinato_placement_* gauges of /metrics)."""
        if not self.forced:
            return {}
        r = self.client.get("/metrics")
        if r.status_code != 200:
            return {}
        out = {}
        for m in re.finditer(r"^ostinato_placement_(\w+) ([0-9.eE+-]+)$", r.text, re.M):
            out[m.group(1)] = float(m.group(2))
        return out

    def body(self, req: TurnRequest) -> tuple[str, dict]:
        body: dict = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                      "temperature": 0.0}
        # an unforced engine is sent our ids where we have them: the tokens Ostinato prefills, and the prefix
        # that hold_output extends. Rendered by llama.cpp's own template instead, tau2's tool lists differed
        # from ours within the first 2000 tokens, so each hold displaced the session's cache (session 27).
        if req.messages is not None and (self.forced or req.prompt_ids is None):
            path = "/v1/chat/completions"
            body["messages"] = req.messages
            if req.tools:
                body["tools"] = req.tools
        else:
            path = "/v1/completions"
            body["prompt"] = req.prompt_ids
        if self.forced:
            if req.output is not None and req.messages is not None:
                keep = ("content", "tool_calls", "reasoning_content")
                body[FORCED_OUTPUT_FIELD] = {"role": "assistant",
                                             **{k: req.output[k] for k in keep if req.output.get(k) is not None}}
            else:
                body[FORCED_IDS_FIELD] = req.forced_ids
            if req.max_output:
                body["max_tokens"] = req.max_output  # cuts the forced output
        else:
            body["max_tokens"] = self.output_length(req)
            body["ignore_eos"] = True
        return path, body

    def output_length(self, req: TurnRequest) -> int:
        if req.forced_ids is not None:
            n = len(req.forced_ids)
        elif self.tokenizer is not None:
            n = len(self.tokenizer.encode(self.tokenizer.render_assistant_output(req.output, req.tools)))
        else:
            from ostinato.sessions.text import message_chars

            n = max(1, message_chars(req.output) // CHARS_PER_TOKEN)
        return min(n, req.max_output or n)

    def run(self, req: TurnRequest) -> TurnResult:
        res = TurnResult(req.session, req.turn, req.kind)
        before = self.placement()
        sent = self.clock()
        if self.api == "anthropic":
            first, last = self._read_messages(req, res)
        else:
            first, last = self._read_chat(req, res)
        res.ttft_s, res.tpot_s, res.request_s = client_timing(sent, first, last, res.output_tokens)
        after = self.placement()
        if after:
            res.placement = {"all": placement_delta(before, after)}
        return res

    def hold_output(self, req: TurnRequest) -> None:
        """Between a turn and the next one of its session, untimed: the engine's cache made to hold
        the turn's prompt and recorded answer, as Ostinato's holds them after its forced decode.

        Why: an engine that takes no forced output (kind 'openai', e.g. llama.cpp) generated its own
        tokens in the answer's place, so its cache holds the prompt but not the recorded answer that
        the next prompt resends, and it would prefill that answer again in the next turn's TTFT. On
        session 26's replays llama.cpp prefilled 56 tokens more a turn than Ostinato (median) on the
        same prompts. So this sends the prompt and the answer's ids (/v1/completions, one token
        generated; the engine's prefix cache reuses the prompt). Its time counts in no turn, which
        favours that engine: Ostinato decodes those tokens inside its timed turns. Needs ids (a
        tokenizer); a failure is counted and the replay goes on."""
        if self.forced or not self.hold_outputs or req.prompt_ids is None or not req.forced_ids:
            return
        body = {"model": self.model, "prompt": req.prompt_ids + req.forced_ids, "max_tokens": 1,
                "temperature": 0.0}
        import httpx

        try:
            self.client.post("/v1/completions", json=body).raise_for_status()
        except httpx.HTTPError:  # the next turn still runs (prefilling the answer again); the count says so
            self.held["failed"] += 1
            return
        self.held["turns"] += 1
        self.held["tokens"] += len(req.forced_ids)

    def _events(self, path: str, body: dict, res: TurnResult):
        """(arrival time, JSON text) of each `data:` line of a streamed POST; an HTTP or connection
        error goes to res.error and ends the stream."""
        try:
            with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                    return
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        yield self.clock(), line[5:].strip()
        except Exception as e:  # noqa: BLE001 - connection errors end this session, not the replay
            res.error = f"{type(e).__name__}: {e}"

    def _read_chat(self, req: TurnRequest, res: TurnResult):
        """One turn through the OpenAI routes -> (first token's time, last token's time)."""
        path, body = self.body(req)
        first = last = None
        pieces = 0
        usage, timings = {}, {}
        for now, data in self._events(path, body, res):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                break
            choices = chunk.get("choices") or []
            if choices:
                has_text = _has_text(choices[0])
                pieces += has_text
                if first is None and (has_text or self.first_token == "chunk"):
                    first = now
                if has_text or choices[0].get("finish_reason"):
                    last = now
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
        self._fill(res, usage, timings, pieces)
        return first, last

    def _read_messages(self, req: TurnRequest, res: TurnResult):
        """One turn through /v1/messages. The first token: message_start, with which our server opens
        the stream once the first token is out, as the OpenAI route's first chunk (first_token
        'chunk'); else the first delta of any block (a tool_use block starts only once its name is
        parsed, some tokens later)."""
        body = {"model": self.model, "stream": True, "temperature": 0.0, **anthropic_messages(req.messages),
                "max_tokens": len(req.forced_ids), FORCED_IDS_FIELD: req.forced_ids}
        if req.tools:
            body["tools"] = [{"name": f["name"], "description": f.get("description", ""),
                              "input_schema": f.get("parameters") or {"type": "object"}}
                             for f in (t.get("function", t) for t in req.tools)]
        first = last = None
        usage: dict = {}
        for now, data in self._events("/v1/messages", body, res):
            event = json.loads(data)
            kind = event.get("type")
            if kind == "error":
                res.error = str(event.get("error", {}).get("message", event))[:300]
                break
            if kind == "message_start":
                usage |= event["message"].get("usage") or {}
                first = now if self.first_token == "chunk" else first
            elif kind == "content_block_delta":
                first = first if first is not None else now
                last = now
            elif kind == "message_delta":
                usage |= event.get("usage") or {}
            elif kind == "message_stop":
                break
        res.output_tokens = usage.get("output_tokens", 0)
        res.cached_tokens = usage.get("cache_read_input_tokens")
        res.prompt_tokens = usage.get("input_tokens", 0) + (res.cached_tokens or 0)
        return first, last

    @staticmethod
    def _fill(res: TurnResult, usage: dict, timings: dict, pieces: int) -> None:
        res.output_tokens = usage.get("completion_tokens") or timings.get("predicted_n") or pieces
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        res.cached_tokens = cached if cached is not None else timings.get("cache_n")
        res.prompt_tokens = usage.get("prompt_tokens") or (timings.get("prompt_n", 0) + (res.cached_tokens or 0))
        if "prompt_ms" in timings:
            res.prefill_s = timings["prompt_ms"] / 1000
        if "predicted_ms" in timings:
            res.decode_s = timings["predicted_ms"] / 1000


def anthropic_messages(messages: list[dict]) -> dict:
    """OpenAI-style chat messages (a recorded session's) -> Anthropic's {system, messages}: system
    text on top; assistant tool calls as tool_use blocks, reasoning as a thinking block; tool
    results as tool_result blocks of a user message (consecutive ones in one)."""
    system, out = [], []
    for m in messages:
        role, content = m["role"], m.get("content")
        text = content if isinstance(content, str) else "".join(
            p.get("text", "") for p in content or [] if isinstance(p, dict))
        if role == "system":
            system.append(text)
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id", ""), "content": text}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list) and \
                    all(b["type"] == "tool_result" for b in out[-1]["content"]):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif role == "assistant":
            blocks = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
            if text:
                blocks.append({"type": "text", "text": text})
            for c in m.get("tool_calls") or []:
                f = c.get("function", {})
                args = f.get("arguments") or "{}"
                blocks.append({"type": "tool_use", "id": c.get("id", ""), "name": f.get("name", ""),
                               "input": json.loads(args) if isinstance(args, str) else args})
            out.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
        else:
            out.append({"role": "user", "content": text})
    return {"system": "\n\n".join(system), "messages": out} if system else {"messages": out}


def _has_text(choice: dict) -> bool:
    delta = choice.get("delta")
    if delta is None:  # text completions
        return bool(choice.get("text"))
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))


def replay_sessions(target, sessions: Iterable, *, tokenizer=None, max_turns: int | None = None,
                    max_output: int | None = None, on_turn: Callable[[TurnResult], None] | None = None,
                    cut: list[tuple[str, int]] | None = None) -> list[TurnResult]:
    """Every turn of every session, in order; a session ends at its first failed turn, or
    before the first turn that does not fit the target's context (noted in `cut`)."""
    results = []
    limit = getattr(target, "max_context", None)
    hold = getattr(target, "hold_output", None)  # HttpTarget: an unforced engine's cache made to hold the answer
    for session in sessions:
        reqs = session_requests(session, tokenizer, max_output)[:max_turns]
        for i, req in enumerate(reqs):
            if limit and req.prompt_ids is not None and len(req.prompt_ids) + len(req.forced_ids) > limit:
                if cut is not None:
                    cut.append((req.session, req.turn))
                break
            r = target.run(req)
            results.append(r)
            if on_turn is not None:
                on_turn(r)
            if r.error:
                break
            if hold is not None and i + 1 < len(reqs):
                hold(req)
    return results


def format_turn(r: TurnResult) -> str:
    """One human line per turn."""
    def ms(v):
        return "-" if v is None else f"{1000 * v:8.1f}"

    head = f"{r.session[-18:]:>18} #{r.turn:<3} {r.kind:5}"
    if r.error:
        return f"{head} FAILED: {r.error}"
    new = "-" if r.new_tokens is None else r.new_tokens
    line = (f"{head} new {new:>5} out {r.output_tokens:>4}  TTFT {ms(r.ttft_s)} ms  TPOT {ms(r.tpot_s)} ms  "
            f"request {r.request_s:7.3f} s")
    dec = r.placement.get("decode") or r.placement.get("all") or {}
    if dec.get("token_layers"):
        line += (f"  cold/tok {dec.get('cold_routes', 0) / dec['token_layers']:.2f}"
                 f"  cpu/tok {dec.get('cpu_experts', 0) / dec['token_layers']:.2f}")
    up = sum(p.get("bytes_uploaded", 0) for p in r.placement.values())
    if up:
        line += f"  up {up / 2**20:.1f} MiB"
    jit = sum(p.get("triton_compiles", 0) for p in r.placement.values())
    if jit:
        line += f"  triton compiles {jit:g} ({sum(p.get('triton_compile_s', 0) for p in r.placement.values()):.2f} s)"
    return line
