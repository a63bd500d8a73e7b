"""The Anthropic Messages API, reasoning split, chat template kwargs, tokenize, model names.

The server runs the tiny synthetic checkpoint with a chat template that opens `<think>`
in the prompt when `enable_thinking` is set (as thinking models' templates do), and writes
a `reasoning_effort` it is given (as gpt-oss's does). The
model's own text is random, so every test that needs a given output forces it: the
wanted text goes through /tokenize, its ids come back as `ostinato_forced_ids`, and
the engine emits exactly those tokens through the whole serving path.
"""
from __future__ import annotations

import inspect
import json
import shutil

import anthropic
import httpx
import openai
import pytest

from ostinato.engine.runner import RunnerSettings
from ostinato.server.app import build_app
from ostinato.server.steering import Asked
from ostinato.synth.chat_template import CHAT_TEMPLATE
from tests.test_server import CTX, KEY, LiveServer, check_parameter_table

NAME, ALIAS = "tiny-think", "tiny-alias"
TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' -}}\n{%- endif -%}"
THINKING_PROMPT = ("{{- '<|im_start|>assistant\\n' -}}\n{%- if reasoning_effort is defined -%}\n"
                   "{{- 'Effort: ' + reasoning_effort + '\\n' -}}\n{%- endif -%}\n"
                   "{%- if enable_thinking is defined and enable_thinking -%}\n"
                   "{{- '<think>\\n' -}}\n{%- endif -%}\n{%- endif -%}")
CALL_TEXT = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')


@pytest.fixture(scope="module")
def thinking_dir(tiny_dir, tmp_path_factory):
    target = tmp_path_factory.mktemp("think") / "tiny"
    shutil.copytree(tiny_dir, target)
    assert CHAT_TEMPLATE.endswith(GENERATION_PROMPT)
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE.removesuffix(GENERATION_PROMPT) + THINKING_PROMPT)
    return target


@pytest.fixture(scope="module")
def live(thinking_dir):
    app = build_app(str(thinking_dir), RunnerSettings(max_context=CTX), api_key=KEY, name=[NAME, ALIAS])
    with LiveServer(app) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, headers={"x-api-key": KEY}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0, timeout=120)


def ids(http, text: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def count(claude, **kw) -> int:
    return claude.messages.count_tokens(model=NAME, **kw).input_tokens


def test_tool_session_through_the_anthropic_client(claude, http):
    turn = dict(model=NAME, max_tokens=200, messages=USER, tools=TOOLS)
    first = claude.messages.create(**turn, extra_body={"ostinato_forced_ids": ids(http, CALL_TEXT)})
    assert first.model == NAME and first.stop_reason == "tool_use" and first.role == "assistant"
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = first.content
    assert thinking.thinking == "The user wants the weather." and text.text == "Let me check."
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    prompt1 = count(claude, messages=USER, tools=TOOLS)
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == prompt1
    assert first.usage.output_tokens == len(ids(http, CALL_TEXT))

    # the same turn streamed: the same blocks, the arguments as input_json_delta pieces
    with claude.messages.stream(**turn, extra_body={"ostinato_forced_ids": ids(http, CALL_TEXT)}) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert {"thinking_delta", "text_delta", "input_json_delta"} <= set(deltas)
    assert deltas.count("input_json_delta") > 1  # the arguments stream as they come
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in first.content]
    assert streamed.stop_reason == "tool_use"
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == prompt1
    assert streamed.usage.cache_read_input_tokens == prompt1 - 1  # the same prompt again

    # second turn: the assistant's blocks and the tool's result go back; the cache holds turn 1
    messages = [*USER, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}]}]
    answer = "It is 21 degrees and sunny in Paris.<|im_end|>"
    second = claude.messages.create(model=NAME, max_tokens=100, messages=messages, tools=TOOLS,
                                    extra_body={"ostinato_forced_ids": ids(http, answer)})
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert second.content[0].text == "It is 21 degrees and sunny in Paris."
    prompt2 = count(claude, messages=messages, tools=TOOLS)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt2
    assert second.usage.cache_read_input_tokens >= prompt1  # the template only appends


def test_tools_reach_the_template_as_the_chat_route_sends_them():
    """A template that writes tools as JSON must write the same text for both front-ends, whatever
    the tokenizer makes of a different key order (a token count alone can hide it)."""
    from ostinato.server.messages_protocol import CountTokensRequest
    from ostinato.server.protocol import ChatRequest

    chat = ChatRequest.model_validate({"model": NAME, "messages": USER, "tools": [
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}} for t in TOOLS]})
    messages = CountTokensRequest.model_validate({"model": NAME, "messages": USER, "tools": TOOLS})
    assert json.dumps(messages.template_tools()) == json.dumps(chat.template_tools())


def test_same_prompt_as_the_openai_route(claude, http):
    """Both front-ends render the same conversation to the same tokens."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    openai_messages = [{"role": "system", "content": "Be brief."}, *USER,
                       {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    want = http.post("/tokenize", json={"messages": openai_messages, "tools": tools}).json()["count"]
    anthropic_messages = [*USER, {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "21 C"}]}]
    assert count(claude, system="Be brief.", messages=anthropic_messages, tools=TOOLS) == want
    assert count(claude, system=[{"type": "text", "text": "Be brief."}], messages=anthropic_messages,
                 tools=TOOLS) == want


def test_streamed_text_matches_the_whole_message(claude):
    kw = dict(model=NAME, max_tokens=10, messages=USER, extra_body={"temperature": 0})
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_max_tokens(claude, http):
    forced = ids(http, "alpha beta gamma delta")
    out = claude.messages.create(model=NAME, max_tokens=3, messages=USER, extra_body={"ostinato_forced_ids": forced})
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 3
    base = claude.messages.create(model=NAME, max_tokens=12, messages=USER, extra_body={"temperature": 0})
    text = base.content[0].text if base.content else ""
    if len(text) < 6:
        pytest.skip("the greedy output is too short to cut")
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = claude.messages.create(model=NAME, max_tokens=12, messages=USER, stop_sequences=[stop],
                                 extra_body={"temperature": 0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert (cut.content[0].text if cut.content else "") == text[:text.find(stop)]


def test_thinking_opened_by_the_template(claude, http):
    """enable_thinking makes the template open <think>: the output starts inside it."""
    forced = ids(http, "I know this.\n</think>\n\nSunny.<|im_end|>")
    on = claude.messages.create(model=NAME, max_tokens=50, messages=USER, thinking={"type": "enabled",
                                "budget_tokens": 1024}, extra_body={"ostinato_forced_ids": forced})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in on.content] == \
        [("thinking", "I know this."), ("text", "Sunny.")]
    assert count(claude, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024}) > \
        count(claude, messages=USER, thinking={"type": "disabled"}) == count(claude, messages=USER)

    client = openai.OpenAI(base_url=http.base_url.join("/v1").__str__(), api_key=KEY, max_retries=0)
    kw = dict(model=NAME, messages=USER, max_tokens=50, extra_body={"ostinato_forced_ids": forced,
                                                                     "chat_template_kwargs": {"enable_thinking": True}})
    whole = client.chat.completions.create(**kw).choices[0].message
    assert whole.model_extra["reasoning_content"] == "I know this." and whole.content == "Sunny."
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "I know this."
    assert "".join(d.content or "" for d in deltas) == "Sunny."
    # without the kwarg the prompt does not open <think>, so nothing is reasoning
    off = client.chat.completions.create(model=NAME, messages=USER, max_tokens=50,
                                         extra_body={"ostinato_forced_ids": forced}).choices[0].message
    assert off.model_extra.get("reasoning_content") is None and "</think>" in off.content


def test_reasoning_written_by_the_model_on_the_openai_route(http):
    message = {"content": "Sunny.", "reasoning_content": "Look it up."}
    body = {"model": NAME, "messages": USER, "max_tokens": 50, "ostinato_forced_output": message}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert whole["reasoning_content"] == "Look it up." and whole["content"] == "Sunny."


def test_tokenize_detokenize_and_names(http, live, claude):
    text = "The weather in Paris <think> 21°C"
    r = http.post("/tokenize", json={"prompt": text}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == CTX
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"model": ALIAS, "messages": USER}).json()
    assert chat["count"] == count(claude, messages=USER)
    assert http.post("/detokenize", json={"tokens": [10 ** 8]}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400
    assert httpx.post(live.url + "/tokenize", json={"prompt": "x"}).status_code == 401  # the key is needed

    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [NAME]
    out = claude.messages.create(model=ALIAS, max_tokens=1, messages=USER)
    assert out.model == NAME  # an alias is answered under the first name
    r = http.post("/v1/messages", json={"model": "claude-opus-4", "max_tokens": 1, "messages": USER})
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {
        "type": "not_found_error", "message": r.json()["error"]["message"]}}
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus-4", max_tokens=1, messages=USER)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model="nope", messages=USER, max_tokens=1)
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404


BAD = [  # (body, status, words the message must contain)
    ({"messages": USER, "max_tokens": 5}, 400, "model"),
    ({"model": NAME, "messages": USER}, 400, "max_tokens"),
    ({"model": NAME, "messages": USER, "max_tokens": 5, "top_k": -1}, 400, "top_k"),
    ({"model": NAME, "messages": USER, "max_tokens": 5, "temperature": 1.5}, 400, "temperature"),
    ({"model": NAME, "messages": [], "max_tokens": 5}, 400, "messages"),
    ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, 400, "content"),
    ({"model": NAME, "max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305",
                                                                   "name": "web_search"}]}, 400, "tools[0]"),
    ({"model": NAME, "max_tokens": 5, "messages": USER, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "nope"),
    ({"model": NAME, "max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}}, 400, "no tools"),
    ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]}, 400, "cannot hold tool_use"),
    ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 600}]}, 400, str(CTX)),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_messages_get_anthropic_errors(http, body, status, words):
    r = http.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


# Every parameter of a messages body (the anthropic client's and ours), as on the OpenAI route
# (test_server.CHAT_PARAMS): honoured, with a check of the Job or the answer; inert; or refused.
MESSAGES_PARAMS = {
    "model": ("honoured", {}, "test_tokenize_detokenize_and_names"),
    "messages": ("honoured", {}, "test_same_prompt_as_the_openai_route"),
    "max_tokens": ("honoured", {"max_tokens": 3}, lambda j, r: j.params.max_tokens == 3),
    "system": ("honoured", {"system": "Be brief."}, lambda j, r: "Be brief." in r.app_prompt),
    "stop_sequences": ("honoured", {"stop_sequences": ["a b"]}, lambda j, r: j.stop == ["a b"]),
    "stream": ("honoured", {"stream": True}, lambda j, r: "event: message_stop" in r.text),
    "temperature": ("honoured", {"temperature": 0.5}, lambda j, r: j.params.temperature == 0.5),
    "top_p": ("honoured", {"top_p": 0.9}, lambda j, r: j.params.top_p == 0.9),
    "top_k": ("honoured", {"top_k": 4}, lambda j, r: j.params.top_k == 4),
    "seed": ("honoured", {"seed": 3}, lambda j, r: j.params.seed == 3),
    "ignore_eos": ("honoured", {"ignore_eos": True}, lambda j, r: j.params.ignore_eos),
    "ostinato_forced_ids": ("honoured", {"ostinato_forced_ids": [5]}, lambda j, r: j.forced == [5]),
    "tools": ("honoured", {"tools": TOOLS}, lambda j, r: "get_weather" in r.app_prompt),
    "tool_choice": ("honoured", {"tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
                    lambda j, r: j.steering.asked == Asked(call=True, name="get_weather", single=True)),
    "thinking": ("honoured", {"max_tokens": 9, "thinking": {"type": "enabled", "budget_tokens": 4}},
                 lambda j, r: r.app_prompt.endswith("<think>\n") and j.steering.asked.budget == 4),
    "output_config": ("honoured", {"output_config": {"effort": "high"}}, lambda j, r: "Effort: high" in r.app_prompt),
    "metadata": ("inert", {"metadata": {"user_id": "u-1"}}, "an identifier for abuse detection"),
    "cache_control": ("inert", {"cache_control": {"type": "ephemeral"}}, "the KV cache is reused on any shared prefix"),
    "service_tier": ("inert", {"service_tier": "standard_only"}, "one queue serves every request"),
    "speed": ("inert", {"speed": "fast"}, "the same"),
    "inference_geo": ("inert", {"inference_geo": "eu"}, "it runs where this server runs"),
    "user_profile_id": ("inert", {"user_profile_id": "p"}, "attribution"),
    "workspace_id": ("inert", {"workspace_id": "w"}, "attribution"),
    "container": ("refused", {"container": "c-1"}, "container"),
    "diagnostics": ("refused", {"diagnostics": {"previous_message_id": "msg_1"}}, "diagnostics"),
    "mcp_servers": ("refused", {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "MCP"),
    "context_management": ("refused", {"context_management": {"edits": []}}, "context_management"),
}
MORE_MESSAGES_REFUSED = [
    ({"tools": [{**TOOLS[0], "strict": True}]}, "strict"),
    ({"tools": [{**TOOLS[0], "input_examples": [{"city": "Oslo"}]}]}, "into the description"),
    ({"tools": [{**TOOLS[0], "defer_loading": True}]}, "tool search"),
    ({"tools": [{**TOOLS[0], "allowed_callers": ["code_execution_20250825"]}]}, "allowed_callers"),
    ({"messages": USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                            "input": {}}]}], "tools": TOOLS}, "tool_result"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}, "thinking.display"),
    ({"thinking": {"type": "between_tools"}}, "thinking.type"),
    ({"thinking": {"type": "disabled", "budget_tokens": 1024}}, "budget_tokens goes with"),
    ({"tools": TOOLS, "tool_choice": {"type": "auto", "name": "get_weather"}}, "a name goes with type 'tool'"),
]


@pytest.fixture
def jobs(live, monkeypatch):
    """The jobs the server hands the engine, as they are submitted."""
    seen = []
    submit = live.app.state.worker.submit
    monkeypatch.setattr(live.app.state.worker, "submit", lambda job: (seen.append(job), submit(job)))
    return seen


def test_every_messages_parameter_is_honoured_or_refused(live, http, monkeypatch):
    from anthropic.resources.messages import Messages

    from ostinato.server.messages_protocol import MessagesRequest

    transport = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
    sdk = set(inspect.signature(Messages.create).parameters) - transport
    assert sdk - set(MESSAGES_PARAMS) == set() and set(MessagesRequest.model_fields) <= set(MESSAGES_PARAMS)

    post = check_parameter_table(live, http, monkeypatch, "/v1/messages",
                                 {"model": NAME, "messages": USER, "max_tokens": 1}, MESSAGES_PARAMS, __name__)
    for body, words in MORE_MESSAGES_REFUSED:
        r, _ = post(body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)


def test_a_final_assistant_message_is_continued(live, claude, jobs):
    prefill = [*USER, {"role": "assistant", "content": "The best answer is ("}]
    out = claude.messages.create(model=NAME, max_tokens=3, messages=prefill, extra_body={"temperature": 0})
    prompt = live.app.state.worker.loaded.tokenizer.decode(jobs[0].prompt)
    assert prompt.endswith("<|im_start|>assistant\nThe best answer is (")  # no end of turn, no new turn
    assert count(claude, messages=prefill) == len(jobs[0].prompt) and out.usage.output_tokens == 3
    blocks = [{"type": "text", "text": "The best "}, {"type": "text", "text": "answer is (  "}]
    claude.messages.create(model=NAME, max_tokens=3, messages=[*USER, {"role": "assistant", "content": blocks}],
                           extra_body={"temperature": 0})
    assert jobs[1].prompt == jobs[0].prompt  # text blocks joined, trailing whitespace dropped


def test_effort_goes_to_a_template_that_reads_it(http, claude):
    client = openai.OpenAI(base_url=str(http.base_url.join("/v1")), api_key=KEY, max_retries=0)
    kw = dict(model=NAME, messages=USER, max_tokens=1, extra_body={"ostinato_return_ids": True})
    low = client.chat.completions.create(**kw, reasoning_effort="low").model_extra["ostinato_prompt_ids"]
    assert "Effort: low\n" in http.post("/detokenize", json={"tokens": low}).json()["prompt"]
    assert count(claude, messages=USER, output_config={"effort": "low"}) == len(low) > count(claude, messages=USER)


def test_a_thinking_budget_closes_the_reasoning(claude):
    """The tiny model never closes its reasoning by itself: the budget does, at the same point of the
    same greedy output, which goes on as the answer."""
    def thought(**thinking):
        out = claude.messages.create(model=NAME, max_tokens=24, messages=USER, thinking=thinking,
                                     extra_body={"ignore_eos": True, "temperature": 0})
        assert out.usage.output_tokens == 24 and out.content[0].type == "thinking", out.content
        return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content]
    short, long = thought(type="enabled", budget_tokens=3), thought(type="enabled", budget_tokens=12)
    [(_, unbounded)] = thought(type="adaptive")  # thinking on, no budget: all of it is reasoning
    assert [kind for kind, _ in short] == [kind for kind, _ in long] == ["thinking", "text"]
    assert short[0][1] and long[0][1].startswith(short[0][1]) and unbounded.startswith(long[0][1])
    assert len(short[0][1]) < len(long[0][1]) < len(unbounded)


def test_tool_choice_tool_writes_the_named_call(claude):
    out = claude.messages.create(model=NAME, max_tokens=40, messages=USER, tools=TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert out.content[0].type == "tool_use" and out.content[0].name == "get_weather"


def test_anthropic_errors_for_auth_and_routes(live, http):
    r = httpx.post(live.url + "/v1/messages", json={"model": NAME, "max_tokens": 1, "messages": USER},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = http.post("/v1/messages/nowhere", json={})
    assert r.status_code == 404 and r.json()["type"] == "error"
    r = http.post("/v1/messages", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_stream_event_sequence(http):
    forced = ids(http, CALL_TEXT)
    body = {"model": NAME, "max_tokens": 200, "messages": USER, "tools": TOOLS, "stream": True,
            "ostinato_forced_ids": forced}
    with http.stream("POST", "/v1/messages", json=body) as r:
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    # every block opens, takes deltas at its own index, and closes before the next opens
    open_block = None
    for d in data:
        if d["type"] == "content_block_start":
            assert open_block is None
            open_block = d["index"]
        elif d["type"] == "content_block_delta":
            assert d["index"] == open_block
        elif d["type"] == "content_block_stop":
            assert d["index"] == open_block
            open_block = None
    assert open_block is None
    args = "".join(d["delta"]["partial_json"] for d in data if d["type"] == "content_block_delta"
                   and d["delta"]["type"] == "input_json_delta")
    assert json.loads(args) == {"city": "Paris"}
    assert data[-2]["delta"]["stop_reason"] == "tool_use" and data[-2]["usage"]["output_tokens"] == len(forced)


def test_tool_call_parser_flag_streams_qwen3_coder_calls(thinking_dir):
    """--tool-call-parser qwen3_coder, end to end on both APIs; an undeclared function stays text."""
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=rm>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>")
    app = build_app(str(thinking_dir), RunnerSettings(max_context=CTX), name=NAME, tool_call_parser="qwen3_coder")
    with LiveServer(app) as server:
        server.wait_ready()
        forced = httpx.post(server.url + "/tokenize", json={"prompt": text + "<|im_end|>"}).json()["tokens"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0]["input_schema"]}}]
        kw = dict(model=NAME, messages=USER, tools=tools, max_tokens=100, extra_body={"ostinato_forced_ids": forced})
        whole = client.chat.completions.create(**kw).choices[0]
        [tc] = whole.message.tool_calls
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "New York"})
        assert whole.message.content.startswith("<tool_call>\n<function=rm>") and whole.finish_reason == "tool_calls"
        pieces = [t.function.arguments for c in client.chat.completions.create(**kw, stream=True) if c.choices
                  for t in c.choices[0].delta.tool_calls or []]
        assert len(pieces) > 2 and "".join(pieces) == tc.function.arguments

        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        out = claude.messages.create(model=NAME, max_tokens=100, messages=USER, tools=TOOLS,
                                     extra_body={"ostinato_forced_ids": forced})
        assert [b.type for b in out.content] == ["tool_use", "text"] and out.content[0].input == {"city": "New York"}
