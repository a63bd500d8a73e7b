"""Request bodies of the OpenAI-compatible API as pydantic models.

Validation happens here, once, in strict mode (no "5" -> 5 coercion), so a bad request
becomes a 400 that names the field before anything reaches the engine queue. Every field
of OpenAI's bodies is honoured, inert by its nature (user, metadata, service_tier, the
prompt-cache hints, prediction: none changes the output) or refused with a 400 that says
what to do (n > 1, logprobs, JSON response formats, strict schemas, audio, store, the old
`functions`; tests/test_server.py lists each); fields no API defines are ignored.
Sampling takes OpenAI's parameters (temperature, top_p, presence_penalty,
frequency_penalty, logit_bias) and vLLM's (top_k, min_p, repetition_penalty); a field left
out (or null) takes the model's default from its generation_config.json, else OpenAI's
(temperature 1, top_p 1, the others off). max_tokens defaults to, and is capped at, the
room the prompt leaves in the context. `model`,
when given, must be one of the served names (else a 404); without it the request goes to the
one model served, as vLLM and llama.cpp's server do.

`chat_template_kwargs` (vLLM's name) are passed to the chat template as variables, e.g.
{"enable_thinking": false} for templates that read it.

tool_choice: "none" renders the prompt without the tools and returns the output as plain
content; "auto" (the default with tools) parses the model family's tool calls into `tool_calls`;
"required" and a named function (validated: tools given, the name among them) make the server
write the opening of a call, named when one is named or only one is declared, and
parallel_tool_calls false ends the output after the first call (server/steering.py); the
arguments are the model's, not constrained by the schema. `reasoning_effort` goes to the chat
template (gpt-oss's reads it), refused where the template does not read it.

Extensions, all optional:

- `ostinato_forced_output` (chat): an assistant message ({content, tool_calls,
  reasoning_content}); the engine emits the tokens of its rendering by the chat template
  (through the end-of-turn token) instead of sampling. A replay of a recorded session
  sends the recorded turn this way so that every placement runs the same tokens.
- `ostinato_forced_ids` (chat and completions): the same, as token ids. A forced output
  is emitted whole (neither end-of-turn tokens nor stop sequences cut it; max_tokens and
  the context do) and reported like sampled output: text, tool calls, usage.
- `ostinato_return_ids`: the response carries `ostinato_prompt_ids` and, per choice,
  `ostinato_output_ids` (in a stream: on the chunk with the finish reason).
- `ignore_eos` (vLLM's name): do not end the turn at end-of-turn tokens; max_tokens does.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ostinato.server.errors import APIError
from ostinato.server.steering import Asked

_FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


_TEMPLATE_OWN = {"messages", "tools", "documents", "add_generation_prompt"}


def check_stops_and_forced(stops: list[str], forced: list[int] | None) -> None:
    """At most 16 non-empty stop sequences; forced ids, if given, not empty (both APIs)."""
    if any(not s for s in stops):
        raise ValueError("stop sequences must be non-empty strings")
    if len(stops) > 16:
        raise ValueError(f"at most 16 stop sequences (got {len(stops)})")
    if forced is not None and not forced:
        raise ValueError("ostinato_forced_ids must hold at least one token id")


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}) with its keys as ints; values in [-100, 100]."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise ValueError(f"logit_bias: the keys are token ids, as strings of digits (got {key!r})")
        if not -100 <= value <= 100:
            raise ValueError(f"logit_bias: token {key} has the bias {value}; biases go from -100 to 100")
        out[int(key)] = value
    return out


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    clash = sorted(_TEMPLATE_OWN & set(kwargs or {}))
    if clash:
        raise ValueError(f"chat_template_kwargs: {', '.join(clash)} are set by the server, not by the request")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "Message":
        if self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise ValueError("an assistant message needs content or tool_calls")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        elif self.tool_calls:
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role}")
        return self

    def for_template(self) -> dict:
        """The dict the chat template reads ('developer' is OpenAI's newer name for 'system')."""
        out = self.model_dump(exclude_none=True)
        if out["role"] == "developer":
            out["role"] = "system"
        return out


class AssistantOutput(_Body):
    """`ostinato_forced_output`: the assistant message to emit."""
    role: Literal["assistant"] = "assistant"
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


def check_schema(p: dict[str, Any] | None, what: str = "parameters") -> None:
    if p is not None:
        if p.get("type", "object") != "object":
            raise ValueError(f"{what} must be a JSON schema with \"type\": \"object\"")
        if not isinstance(p.get("properties", {}), dict):
            raise ValueError(f"{what}.properties must be an object")
        if not isinstance(p.get("required", []), list):
            raise ValueError(f"{what}.required must be a list of property names")


class FunctionDef(_Body):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> "FunctionDef":
        check_schema(self.parameters)
        if self.strict:
            raise ValueError("strict: true asks for arguments that always match the schema, which needs constrained "
                             "decoding this server does not have: send strict false (or leave it out)")
        return self


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """Fields shared by chat and text completions."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: the model's default, else 1
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    ignore_eos: bool = False
    ostinato_forced_ids: list[int] | None = None
    ostinato_return_ids: bool = False

    @model_validator(mode="after")
    def _check_common(self) -> "_Generation":
        logit_bias_ids(self.logit_bias)
        if self.n != 1:
            raise ValueError(f"n must be 1: this server keeps one session slot and returns one choice (got {self.n})")
        if self.logprobs not in (None, False, 0) or self.top_logprobs not in (None, 0):
            raise ValueError("logprobs (and top_logprobs) are not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options go with stream: true")
        if self.store:
            raise ValueError("store: true is not supported (this server keeps no completions to fetch later)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not supported "
                             "(no constrained decoding): ask for the format in the prompt")
        check_stops_and_forced(self.stop_list(), self.ostinato_forced_ids)
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def asked(self) -> Asked:
        return Asked()


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # a chat template variable (gpt-oss reads it)
    chat_template_kwargs: dict[str, Any] | None = None
    ostinato_forced_output: AssistantOutput | None = None
    # OpenAI's, refused when they ask for something (see _check_chat)
    functions: list[Any] | None = None
    function_call: Any = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    verbosity: str | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatRequest":
        check_template_kwargs(self.chat_template_kwargs)
        if self.functions is not None or self.function_call is not None:
            raise ValueError("functions and function_call are the old form of tools: send tools and tool_choice")
        if self.audio is not None or (self.modalities is not None and self.modalities != ["text"]):
            raise ValueError("this server writes text only: leave audio out and modalities at [\"text\"]")
        if self.web_search_options is not None:
            raise ValueError("web_search_options: this server has no web search; declare a search tool instead")
        if self.moderation is not None:
            raise ValueError("moderation is not supported: this server runs no moderation model")
        if self.verbosity not in (None, "medium"):
            raise ValueError(f"verbosity {self.verbosity!r} is not supported: ask for the length in the prompt")
        if self.reasoning_effort is not None and "reasoning_effort" in (self.chat_template_kwargs or {}):
            raise ValueError("give reasoning_effort or chat_template_kwargs.reasoning_effort, not both")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise ValueError("tool_choice is 'required' but no tools were given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            known = ", ".join(names) or "none"
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, "
                             f"which is not among the tools (known: {known})")
        if self.ostinato_forced_output is not None and self.ostinato_forced_ids is not None:
            raise ValueError("give ostinato_forced_output or ostinato_forced_ids, not both")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_tools(self) -> list[dict] | None:
        """Tools as the chat template sees them: none at all with tool_choice 'none'."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_kwargs(self) -> dict[str, Any]:
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**(self.chat_template_kwargs or {}), **effort}

    def asked(self) -> Asked:
        """'required' and a named function make the server write a call's opening (with the
        name when one is named or only one declared); parallel_tool_calls false ends the
        output after the first call (server/steering.py)."""
        names = [t.function.name for t in self.tools or []] if self.tool_choice != "none" else []
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        call = named is not None or (self.tool_choice == "required" and bool(names))
        if call and named is None and len(names) == 1:
            named = names[0]
        return Asked(call=call, name=named, single=self.parallel_tool_calls is False and bool(names))


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and (not self.prompt or isinstance(self.prompt[0], str)) \
                and len(self.prompt) != 1:
            raise ValueError("prompt: give one string (a batch of prompts is not supported)")
        if self.echo or self.suffix or self.best_of not in (None, 1):
            raise ValueError("echo, suffix and best_of are not supported")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt as it is, or messages through the chat template."""
    model: str | None = None  # optional, as in vLLM
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_tokenize(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        check_template_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _field_names(cls: type[BaseModel]) -> set[str]:
    names = set(cls.model_fields)
    for sub in cls.__subclasses__():
        names |= _field_names(sub)
    return names


def _where(loc: tuple, fields: set[str]) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content': union-branch tags such as
    'str' or 'list[TextPart]' are not fields and are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in fields:
            out += f".{part}" if out else part
    return out


def parse_body(model: type[_Body], raw: bytes) -> _Body:
    """Bytes of a request body -> a validated request, or a 400 that names the field."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        raise APIError(400, f"the request body is not valid JSON ({first['msg']})", code="invalid_json")
    fields = _field_names(_Body)
    where = _where(tuple(first["loc"]), fields)
    # The branches of a union fail together; say what each would have accepted.
    same = [err for err in errors if _where(tuple(err["loc"]), fields) == where]
    message = "; or ".join(dict.fromkeys(err["msg"].removeprefix("Value error, ") for err in same))
    more = len({_where(tuple(err["loc"]), fields) for err in errors}) - 1
    message += f" (and problems in {more} more fields)" if more else ""
    raise APIError(400, f"{where}: {message}" if where else message, param=where or None, code="invalid_value")
