"""Request bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens).

A second front-end over the same generation path: a request is validated here (strict,
like the OpenAI bodies) and translated into the chat template's OpenAI-shaped messages,
so both APIs render the same prompt for the same conversation and share the KV cache:

- `system` (a string or text blocks) -> a system message;
- assistant `text` / `thinking` / `tool_use` blocks -> content / reasoning_content /
  tool_calls (the input object as the arguments);
- user `tool_result` blocks -> tool messages (in order, before the user's own text);
- `tools` ({name, description, input_schema}) -> functions; `tool_choice` none hides
  them, any / tool make the server write a call's opening and disable_parallel_tool_use
  ends the output after one call, as on the OpenAI route (server/steering.py);
- `thinking: {type: enabled | adaptive | disabled}` -> the template variables
  `enable_thinking` (Qwen3's) and `thinking` (DeepSeek V3.1's); an enabled thinking's
  `budget_tokens` closes the reasoning once spent;
- `output_config.effort` -> the template variable `reasoning_effort`, where it is read;
- a final assistant message (a prefill) is continued: the prompt ends with its text, and
  the answer holds what follows it.

Sampling: temperature, top_p and top_k (0: off); a field left out takes the model's
default (generation_config.json), else Anthropic's (temperature 1, top_p 1, no top_k).
Images, documents, server tools, output formats, containers, MCP servers and context
editing are refused by validation; metadata, cache_control, service_tier and the like
change nothing here (tests/test_anthropic.py lists each field). Extensions as on the OpenAI
route: `ostinato_forced_ids`, `seed`, `ignore_eos`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from ostinato.server.protocol import (
    _FUNCTION_NAME,
    _Body,
    check_schema,
    check_stops_and_forced,
)
from ostinato.server.steering import Asked


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


ContentBlock = Annotated[Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock],
                         Field(discriminator="type")]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _check(self) -> "AnthropicMessage":
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        wrong = kinds & ({"tool_result"} if self.role == "assistant" else {"tool_use", "thinking", "redacted_thinking"})
        if wrong:
            raise ValueError(f"a {self.role} message cannot hold {', '.join(sorted(wrong))} blocks")
        return self

    def for_template(self) -> list[dict]:
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = "".join(b.text for b in self.content if b.type == "text")
        if self.role == "user":
            out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                   for b in self.content if b.type == "tool_result"]
            return out + [{"role": "user", "content": texts}] if texts or not out else out
        message: dict[str, Any] = {"role": "assistant", "content": texts}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in self.content if b.type == "tool_use"]
        thinking = "".join(b.thinking for b in self.content if b.type == "thinking")
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = thinking
        return [message]


class AnthropicTool(_Body):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    input_examples: list[Any] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> "AnthropicTool":
        check_schema(self.input_schema, "input_schema")
        if self.strict:
            raise ValueError("strict: true asks for inputs that always match the schema, which needs constrained "
                             "decoding this server does not have: leave it out")
        if self.input_examples:
            raise ValueError("input_examples are not shown to the model here: write them into the description")
        if self.defer_loading:
            raise ValueError("defer_loading needs tool search, which this server does not have")
        if self.allowed_callers not in (None, ["direct"]):
            raise ValueError("allowed_callers: only direct calls (no code execution here)")
        return self


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> "ToolChoice":
        if (self.name is None) == (self.type == "tool"):
            raise ValueError("a name goes with type 'tool', and only with it")
        return self


class ThinkingConfig(_Body):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized"] | None = None  # the thinking is returned as written

    @model_validator(mode="after")
    def _check(self) -> "ThinkingConfig":
        if self.budget_tokens is not None and self.type != "enabled":
            raise ValueError("budget_tokens goes with type 'enabled'")
        return self

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class Metadata(_Body):
    user_id: str | None = Field(None, max_length=256)


class OutputConfig(_Body):
    effort: str | None = None  # the chat template's reasoning_effort (gpt-oss reads it)
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> "OutputConfig":
        if self.format is not None:
            raise ValueError("output_config.format is not supported (no constrained decoding): ask for the format "
                             "in the prompt")
        return self


class Conversation(_Body):
    """What count_tokens and messages share: everything that shapes the prompt."""
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _check_conversation(self) -> "Conversation":
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice is {choice.type!r} but no tools were given")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names the tool {choice.name!r}, which is not among the tools "
                             f"(known: {', '.join(names) or 'none'})")
        self.prefill()
        return self

    def prefill(self) -> str | None:
        """The text of a final assistant message, which the answer continues (Anthropic's prefill)."""
        last = self.messages[-1]
        if last.role != "assistant":
            return None
        if isinstance(last.content, list) and any(b.type != "text" for b in last.content):
            raise ValueError("a final assistant message is continued, so it holds text blocks only (a tool_use "
                             "needs the user's tool_result after it)")
        text = last.content if isinstance(last.content, str) else "".join(b.text for b in last.content)
        return text.rstrip() or None

    def template_messages(self) -> list[dict]:
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        head = [{"role": "system", "content": system}] if self.system is not None else []
        return head + [m for message in self.messages for m in message.for_template()]

    def template_tools(self) -> list[dict] | None:
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        # the chat route's order (protocol.FunctionDef): a template that writes a tool as JSON writes the same text
        return [{"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description
                                                                     else {}), "parameters": t.input_schema}}
                for t in self.tools]

    def template_kwargs(self) -> dict[str, Any]:
        """`thinking` -> `enable_thinking` (Qwen3's variable) and `thinking` (DeepSeek V3.1's);
        `output_config.effort` -> `reasoning_effort`."""
        out = {} if self.thinking is None else {"enable_thinking": self.thinking.on, "thinking": self.thinking.on}
        if self.output_config is not None and self.output_config.effort is not None:
            out["reasoning_effort"] = self.output_config.effort
        return out


class CountTokensRequest(Conversation):
    pass


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # None: the model's default, else 1
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    seed: int | None = None
    ignore_eos: bool = False
    ostinato_forced_ids: list[int] | None = None
    # Anthropic's, refused: they need what this server does not run
    container: Any = None
    mcp_servers: Any = None
    diagnostics: Any = None
    context_management: Any = None

    @model_validator(mode="after")
    def _check_generation(self) -> "MessagesRequest":
        check_stops_and_forced(self.stop_list(), self.ostinato_forced_ids)
        for name, what in (("container", "code-execution containers"), ("mcp_servers", "an MCP connector"),
                           ("diagnostics", "prompt-cache diagnostics"), ("context_management", "context editing")):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported: this server has no {what}")
        return self

    def asked(self) -> Asked:
        """'any' and 'tool' make the server write a call's opening, disable_parallel_tool_use ends
        the output after the first call, an enabled thinking's budget_tokens closes the reasoning
        once spent (server/steering.py)."""
        c = self.tool_choice
        names = [t.name for t in self.tools or []] if c is None or c.type != "none" else []
        call = c is not None and c.type in ("any", "tool") and bool(names)
        name = c.name if call and c.type == "tool" else (names[0] if call and len(names) == 1 else None)
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        return Asked(call=call, name=name, single=bool(c and c.disable_parallel_tool_use) and bool(names),
                     budget=budget)

    def stop_list(self) -> list[str]:
        return list(self.stop_sequences or [])

    @property
    def output_limit(self) -> int:
        return self.max_tokens
