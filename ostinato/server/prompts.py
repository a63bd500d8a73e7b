"""A validated request -> the engine's inputs: prompt ids, sampling, forced ids, stops.

Everything that needs the tokenizer or the context size is checked here, on the
request side, so a prompt that cannot fit or a forced id outside the vocabulary is a
400 before it takes a place in the engine queue.
"""
from __future__ import annotations

from dataclasses import dataclass

from ostinato.engine.sampling import SamplingParams
from ostinato.loader.tokenizer import ChatTemplateError
from ostinato.server.errors import APIError
from ostinato.server.protocol import ChatRequest, CompletionRequest


@dataclass
class Prepared:
    prompt: list[int]
    params: SamplingParams
    forced: list[int] | None
    stop: list[str]
    parse_tools: bool  # tools were given to the template: look for tool calls in the output


def _check_ids(ids: list[int], vocab: int, param: str) -> list[int]:
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)
    return ids


def _params(req: ChatRequest | CompletionRequest, prompt: list[int], max_context: int) -> SamplingParams:
    if len(prompt) >= max_context:
        raise APIError(400, f"the prompt has {len(prompt)} tokens but the context holds {max_context} "
                            "(prompt and output together): shorten the conversation or start the server "
                            "with a larger --max-context", param="messages", code="context_length_exceeded")
    room = max_context - len(prompt)
    limit = room if req.output_limit is None else min(req.output_limit, room)
    return SamplingParams(max_tokens=limit, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                          ignore_eos=req.ignore_eos)


def prepare_chat(req: ChatRequest, loaded) -> Prepared:
    tok = loaded.tokenizer
    tools = req.template_tools()
    messages = [m.for_template() for m in req.messages]
    try:
        prompt = tok.render_ids(messages, tools)
        forced = None
        if req.ostinato_forced_output is not None:
            message = req.ostinato_forced_output.model_dump(exclude_none=True)
            forced = tok.encode(tok.render_assistant_output(message, tools))
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    if req.ostinato_forced_ids is not None:
        forced = _check_ids(req.ostinato_forced_ids, loaded.runner.config.vocab_size, "ostinato_forced_ids")
    return Prepared(prompt, _params(req, prompt, loaded.engine.max_context), forced, req.stop_list(),
                    parse_tools=tools is not None)


def prepare_completion(req: CompletionRequest, loaded) -> Prepared:
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
    return Prepared(prompt, _params(req, prompt, loaded.engine.max_context), forced, req.stop_list(),
                    parse_tools=False)
