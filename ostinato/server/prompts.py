"""A validated request -> the engine's inputs: prompt ids, sampling, forced ids, stops.

Everything that needs the tokenizer or the context size is checked here, on the
request side, so a prompt that cannot fit or a forced id outside the vocabulary is a
400 before it takes a place in the engine queue. Chat (OpenAI) and messages (Anthropic)
requests render through the same chat template call; `Prepared` also says what the
output's parser needs: the declared tools, and whether the prompt opened a `<think>`
(then the output starts inside the reasoning).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ostinato.engine.sampling import SamplingDefaults, SamplingParams
from ostinato.loader.tokenizer import ChatTemplateError
from ostinato.server.errors import APIError
from ostinato.server.messages_protocol import Conversation, MessagesRequest
from ostinato.server.parsing.base import THINK_OPEN
from ostinato.server.protocol import ChatRequest, CompletionRequest, logit_bias_ids
from ostinato.server.steering import Asked


@dataclass
class Prepared:
    prompt: list[int]
    params: SamplingParams
    forced: list[int] | None
    stop: list[str]
    tools: dict[str, dict] | None  # declared functions (name -> parameters schema) to parse calls of
    in_reasoning: bool = False  # the prompt ends inside an opened <think>
    asked: Asked = Asked()  # what the server is to write into the output (server/steering.py)


@dataclass
class Rendered:
    ids: list[int]
    text: str
    tools: list[dict] | None

    @property
    def declared(self) -> dict[str, dict] | None:
        if self.tools is None:
            return None
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}

    @property
    def opens_reasoning(self) -> bool:
        return self.text.rstrip().endswith(THINK_OPEN)


def render(tok, messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any] | None,
           add_generation_prompt: bool = True, continued: str | None = None) -> Rendered:
    """`continued`: the final assistant message's text, which the output continues: the prompt
    ends right after it (no end of turn, no new generation prompt)."""
    try:
        text = tok.apply_chat_template(messages, tools, add_generation_prompt and continued is None,
                                       **(kwargs or {}))
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    if continued is not None:
        at = text.rfind(continued)
        if at < 0:
            raise APIError(400, "the chat template does not write the final assistant message's text as it is, "
                                "so it cannot be continued: end the messages with a user turn", param="messages")
        text = text[:at + len(continued)]
    return Rendered(tok.encode(text), text, tools)


def check_template_reads(tok, variable: str, param: str) -> None:
    """A request field that becomes a chat template variable needs a template that reads it."""
    if not any(variable in template for template in tok.templates.values()):
        raise APIError(400, f"{param}: this model's chat template does not read {variable}, so it would change "
                            "nothing: leave it out", param=param)


def _check_ids(ids: list[int], vocab: int, param: str) -> list[int]:
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)
    return ids


# (field, the API's default where the model gives none); a field a body lacks takes the model's
_SAMPLING = (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0),
             ("presence_penalty", 0.0), ("frequency_penalty", 0.0))


def _params(req, prompt: list[int], loaded, defaults: SamplingDefaults) -> SamplingParams:
    """The request's sampling, its gaps filled from the model's defaults, else the API's."""
    max_context = loaded.engine.max_context
    if len(prompt) >= max_context:
        raise APIError(400, f"the prompt has {len(prompt)} tokens but the context holds {max_context} "
                            "(prompt and output together): shorten the conversation or start the server "
                            "with a larger --max-context", param="messages", code="context_length_exceeded")
    room = max_context - len(prompt)
    limit = room if req.output_limit is None else min(req.output_limit, room)
    sampling = {name: defaults.get(name, api_default) if getattr(req, name, None) is None else getattr(req, name)
                for name, api_default in _SAMPLING}
    bias = logit_bias_ids(getattr(req, "logit_bias", None))
    vocab = loaded.runner.config.vocab_size
    bad = next((i for i in bias if i >= vocab), None)
    if bad is not None:
        raise APIError(400, f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                       param="logit_bias")
    return SamplingParams(max_tokens=limit, seed=req.seed, ignore_eos=req.ignore_eos, logit_bias=bias, **sampling)


def prepare_chat(req: ChatRequest, loaded, defaults: SamplingDefaults) -> Prepared:
    tok = loaded.tokenizer
    if req.reasoning_effort is not None:
        check_template_reads(tok, "reasoning_effort", "reasoning_effort")
    rendered = render(tok, [m.for_template() for m in req.messages], req.template_tools(), req.template_kwargs())
    forced = None
    if req.ostinato_forced_output is not None:
        message = req.ostinato_forced_output.model_dump(exclude_none=True)
        try:
            forced = tok.encode(tok.render_assistant_output(message, rendered.tools))
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="ostinato_forced_output") from None
    if req.ostinato_forced_ids is not None:
        forced = _check_ids(req.ostinato_forced_ids, loaded.runner.config.vocab_size, "ostinato_forced_ids")
    return Prepared(rendered.ids, _params(req, rendered.ids, loaded, defaults), forced, req.stop_list(),
                    rendered.declared, rendered.opens_reasoning, req.asked())


def render_conversation(req: Conversation, loaded) -> Rendered:
    if req.output_config is not None and req.output_config.effort is not None:
        check_template_reads(loaded.tokenizer, "reasoning_effort", "output_config.effort")
    return render(loaded.tokenizer, req.template_messages(), req.template_tools(), req.template_kwargs(),
                  continued=req.prefill())


def prepare_messages(req: MessagesRequest, loaded, defaults: SamplingDefaults) -> Prepared:
    rendered = render_conversation(req, loaded)
    forced = None
    if req.ostinato_forced_ids is not None:
        forced = _check_ids(req.ostinato_forced_ids, loaded.runner.config.vocab_size, "ostinato_forced_ids")
    return Prepared(rendered.ids, _params(req, rendered.ids, loaded, defaults), forced, req.stop_list(),
                    rendered.declared, rendered.opens_reasoning, req.asked())


def prepare_completion(req: CompletionRequest, loaded, defaults: SamplingDefaults) -> Prepared:
    tok = loaded.tokenizer
    vocab = loaded.runner.config.vocab_size
    if isinstance(req.prompt, str):
        prompt = tok.encode(req.prompt)
    elif req.prompt and isinstance(req.prompt[0], str):
        prompt = tok.encode(req.prompt[0])
    else:
        prompt = _check_ids(list(req.prompt), vocab, "prompt")
    if not prompt:
        raise APIError(400, "prompt: the prompt is empty", param="prompt")
    forced = None
    if req.ostinato_forced_ids is not None:
        forced = _check_ids(req.ostinato_forced_ids, vocab, "ostinato_forced_ids")
    return Prepared(prompt, _params(req, prompt, loaded, defaults), forced, req.stop_list(), tools=None)
