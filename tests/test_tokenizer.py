"""The synthetic tokenizer and our chat renderer against transformers, on a tiny corpus.

transformers is the oracle: same ids, same rendered prompts. The prefix test checks the
property KV-cache reuse across turns depends on.
"""

import json
import random
from pathlib import Path

import pytest

from ostinato.loader.tokenizer import ChatTokenizer, StreamDecoder, TokenizerDirError
from ostinato.synth.tokenizer import CONTROL_TOKENS, MARKUP_TOKENS, train_tokenizer

VOCAB = 3000

WORDS = ("file read write list search the a of to in is function error test pass fail build "
         "run path config value return import class def self user assistant tool result "
         "directory python json output input line number string update patch commit").split()
UNICODE = ("café", "naïve", "Größe", "日本語のテキスト", "données", "😀", "🚀 déploiement", "ß", "Ελληνικά")


def _corpus(seed: int = 0, n: int = 500) -> list[str]:
    """Agent-like text: prose, tool calls, JSON results, code, unicode (about 300 KB)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = " ".join(rng.choices(WORDS, k=rng.randint(5, 25)))
        args = {"path": "/".join(rng.choices(WORDS, k=3)) + ".py", "line": rng.randint(1, 999)}
        call = json.dumps({"name": rng.choice(WORDS) + "_" + rng.choice(WORDS), "arguments": args})
        code = f"def {rng.choice(WORDS)}(x, y=None):\n    return x + {rng.randint(0, 99)}  # {rng.choice(WORDS)}\n"
        out.append(f"<|im_start|>user\n{words.capitalize()}? {rng.choice(UNICODE)}<|im_end|>\n"
                   f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
                   f"<tool_response>\n{json.dumps({'ok': rng.random() < 0.5, 'lines': [words]})}\n</tool_response>\n"
                   f"{words}.\n\n{code}\n\n\n\t{words}.\r\n")
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tok")
    info = train_tokenizer(_corpus(), VOCAB, out)
    return out, info


@pytest.fixture(scope="module")
def ours(trained) -> ChatTokenizer:
    return ChatTokenizer.from_dir(trained[0])


@pytest.fixture(scope="module")
def hf(trained):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(trained[0]))


TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file <safely> & quickly",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite", "parameters": {"type": "object", "properties": {}}}},
]


def _agent_session() -> list[dict]:
    """System, user, assistant with two calls, two tool results, answer, user, answer."""
    return [
        {"role": "system", "content": "You are a coding agent. Prefer small patches."},
        {"role": "user", "content": "Fix the failing test in café/naïve.py 🚀"},
        {"role": "assistant", "content": "\n\nLet me look first.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "read_file", "arguments": {"z": 1, "path": "café/naïve.py"}}},
            {"id": "b", "type": "function", "function": {"name": "run_tests", "arguments": "{\"only\":[\"t1\"]}"}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "def f(x):\n    return x + 1\n"},
        {"role": "tool", "tool_call_id": "b", "content": json.dumps({"failed": ["t1"], "größe": 3}, ensure_ascii=False)},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": {"path": "tests/t1.py"}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "assert f(1) == 3"},
        {"role": "assistant", "content": "\nThe test expects +2; I changed `f`.", "reasoning_content": "f adds 1, test wants 3"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks! Now  run\tall of them."}]},
        {"role": "assistant", "content": "\nAll 12 tests pass. 日本語 ok."},
    ]


CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "hi"}], None),
    "system_only": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], None),
    "tools_no_system": ([{"role": "user", "content": "list files"}], TOOLS),
    "empty_tools": ([{"role": "user", "content": "list files"}], []),
    "session": (_agent_session(), TOOLS),
    "session_no_tools": (_agent_session(), None),
}


def test_info_and_files(trained, ours):
    out, info = trained
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert info.vocab_size == ours.vocab_size <= VOCAB
    names = CONTROL_TOKENS + MARKUP_TOKENS
    assert sorted(info.special_ids.values()) == list(range(info.vocab_size - len(names), info.vocab_size))
    assert info.eos_id == ours.token_id("<|im_end|>") and info.pad_id == ours.token_id("<|endoftext|>")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    decoder = config["added_tokens_decoder"]
    assert {v["content"]: v["special"] for v in decoder.values()} == {t: t in CONTROL_TOKENS for t in names}


def test_training_is_deterministic(trained, tmp_path: Path):
    train_tokenizer(_corpus(), VOCAB, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (trained[0] / name).read_bytes()


def test_training_caps_the_corpus(tmp_path: Path):
    """Text past max_chars is never seen: appending more changes nothing."""
    corpus = _corpus(n=200)
    cap = sum(map(len, corpus[:150])) - 7
    train_tokenizer(corpus[:150], 1000, tmp_path / "a", max_chars=cap)
    train_tokenizer(corpus + ["zzzqqq " * 10_000], 1000, tmp_path / "b", max_chars=cap)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


STRINGS = [
    "hello world",
    "Größe, naïve café — 日本語のテキスト 😀🚀 Ελληνικά",
    '{"name": "read_file", "arguments": {"path": "a/b.py", "line": 12, "x": [1.5e-3, null, true]}}',
    "def f(x, y=None):\n    return x ** 2  # square\r\n\tpass\n\n\n",
    "   leading and trailing   \n  \t ",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call><think>ok</think>",
    "numbers 1234567890 3.14159 -42 0x1F",
    "",
]


@pytest.mark.parametrize("text", STRINGS)
def test_encode_matches_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text == hf.decode(ids)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_matches_transformers(ours, hf, name, add_generation_prompt):
    messages, tools = CONVERSATIONS[name]
    text = ours.apply_chat_template(messages, tools, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    tokenize=False)
    assert text == theirs
    ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                 tokenize=True, return_dict=False)
    assert ours.render_ids(messages, tools, add_generation_prompt) == list(ids)


def test_template_layout(ours):
    text = ours.apply_chat_template(*CONVERSATIONS["session"])
    assert text.startswith("<|im_start|>system\nYou are a coding agent. Prefer small patches.\n\n# Tools")
    assert '"description": "Read a file <safely> & quickly"' in text  # no HTML escaping
    assert '{"name": "read_file", "arguments": {"z": 1, "path": "café/naïve.py"}}' in text  # no key sorting
    assert '{"name": "run_tests", "arguments": {"only":["t1"]}}' in text  # string arguments verbatim
    assert "</tool_response>\n<tool_response>" in text and text.count("<|im_start|>user\n<tool_response>") == 2
    assert "<think>\nf adds 1, test wants 3\n</think>\n\nThe test" in text
    assert text.endswith("All 12 tests pass. 日本語 ok.<|im_end|>\n<|im_start|>assistant\n")


def test_round_trip(ours):
    text = ours.apply_chat_template(*CONVERSATIONS["session"])
    assert ours.decode(ours.encode(text)) == text


def test_parse_recovers_tool_calls(ours):
    for message in _agent_session():
        if message["role"] != "assistant":
            continue
        body = ours.render_assistant_output(message)
        content, calls = ours.parse_assistant_output(body)
        thinking = f"<think>\n{message['reasoning_content']}\n</think>\n\n" if "reasoning_content" in message else ""
        assert content == thinking + (message["content"] or "").lstrip()
        sent = [c["function"] for c in message.get("tool_calls", [])]
        assert [c["function"]["name"] for c in calls] == [f["name"] for f in sent]
        for got, want in zip(calls, sent):
            args = want["arguments"]
            assert json.loads(got["function"]["arguments"]) == (json.loads(args) if isinstance(args, str) else args)
            assert got["type"] == "function" and got["id"].startswith("call_")
        again = {"role": "assistant", "content": content, "tool_calls": calls}
        assert ours.render_assistant_output(again) == body  # parse is the inverse of render
        assert ours.parse_assistant_output(body)[1] == calls  # deterministic ids


def test_parse_keeps_malformed_calls_in_content(ours):
    text = ('Trying.\n<tool_call>\n{"name": "read_file", "arguments": {"path": }\n</tool_call>\n'
            '<tool_call>\n{"name":"run_tests","arguments":{"k" : 1}}\n</tool_call>\n<tool_call>\n{"name": "cut')
    content, calls = ours.parse_assistant_output(text + "<|im_end|>")
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"k": 1}]
    assert '"arguments": {"path": }' in content and content.endswith('{"name": "cut')
    assert ours.parse_assistant_output("just text") == ("just text", [])


def test_stream_decoder_matches_full_decode(ours):
    text = "Größe 日本語のテキスト 😀🚀 naïve — Ελληνικά " * 3 + '{"ok": "✓"}'
    ids = ours.encode(text)
    for decoder in (ours.stream_decoder(), _text_window_decoder(ours)):
        deltas = [decoder.feed(i) for i in ids]
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) + decoder.flush() == text == ours.decode(ids)
    # Single bytes of a split emoji: held back, then released whole.
    emoji = [ours.token_bytes.index(bytes([b])) for b in "😀".encode()]
    decoder = ours.stream_decoder()
    assert [decoder.feed(i) for i in emoji] == ["", "", "", "😀"]


def _text_window_decoder(ours: ChatTokenizer) -> StreamDecoder:
    """The path used by tokenizers that are not byte-level."""
    decoder = StreamDecoder(ours)
    decoder._bytes = None
    return decoder


def test_forced_outputs_keep_the_prompt_prefix(ours):
    """Prompt of turn i+1 starts with prompt_i + forced output_i, token for token."""
    messages, tools = CONVERSATIONS["session"]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i, j in zip(turns, turns[1:]):
        prompt = ours.render_ids(messages[:i], tools)
        forced = ours.encode(ours.render_assistant_output(messages[i], tools))
        assert forced[-1] in ours.eos_ids
        following = ours.render_ids(messages[:j], tools)
        assert following[:len(prompt) + len(forced)] == prompt + forced


def test_eos_ids(trained, tmp_path: Path, ours):
    assert ours.eos_ids == {ours.token_id("<|im_end|>"), ours.token_id("<|endoftext|>")}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((trained[0] / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ChatTokenizer.from_dir(tmp_path).eos_ids == ours.eos_ids | {7, 9}


@pytest.mark.parametrize("broken", ["no_dir", "no_tokenizer", "no_config", "bad_json", "bad_tokenizer"])
def test_clear_errors(trained, tmp_path: Path, broken):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((trained[0] / name).read_bytes())
    target = {"no_dir": tmp_path / "absent", "no_tokenizer": tmp_path / "tokenizer.json",
              "no_config": tmp_path / "tokenizer_config.json", "bad_json": tmp_path / "tokenizer_config.json",
              "bad_tokenizer": tmp_path / "tokenizer.json"}[broken]
    if broken.startswith("no_") and broken != "no_dir":
        target.unlink()
    elif broken.startswith("bad_"):
        target.write_text('{"model": {"type": "BPE", "vocab": ' if broken == "bad_json" else '{"model": 3}')
    with pytest.raises(TokenizerDirError) as err:
        ChatTokenizer.from_dir(tmp_path / "absent" if broken == "no_dir" else tmp_path)
    message = str(err.value)
    assert target.name in message and "\n" not in message
