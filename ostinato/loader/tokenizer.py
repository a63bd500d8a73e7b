"""Tokenizer and chat template of a checkpoint directory, without importing transformers.

The engine needs encode/decode, the chat template and the ids that end a turn; importing
transformers for that costs seconds at start-up. So this module reads the same files and
does what transformers does with them, closely enough that the two agree exactly (the
tests compare them):

- tokenizer.json through `tokenizers`; encoding adds no BOS or other special tokens;
- the chat template from chat_template.jinja (which wins, as in transformers) or
  tokenizer_config.json, rendered in a sandboxed jinja environment configured like
  transformers' (trim_blocks, lstrip_blocks, loop controls, a `tojson` that neither sorts
  keys nor escapes HTML, `raise_exception`, `strftime_now`), with messages normalised the
  same way (None-valued keys dropped, `reasoning_content` aliased) and the special
  tokens passed as template variables.

A GGUF file carries its tokenizer in its metadata (tokens, merges, token types, special
ids, chat template): `from_dir` given a .gguf file (or a directory holding one and no
tokenizer_config.json) rebuilds the same `tokenizers` BPE from it, for the byte-level BPE
("gpt2") tokenizers with a pre-tokenizer llama.cpp names and we know (Qwen2's split).

Tool calls follow the synthetic checkpoints' template (ostinato/synth/chat_template.py):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks after the content.
"""

import codecs
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from gguf import TokenType
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from ostinato.loader.gguf import file_metadata, find_gguf

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# The exact layout the template writes; lets a parsed call keep the model's own argument text.
_CANONICAL_CALL = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (.*)\}', re.DOTALL)
# llama.cpp's names (tokenizer.ggml.pre) for the pre-tokenizer splits we can rebuild exactly.
GGUF_PRE_TOKENIZERS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


class TokenizerDirError(ValueError):
    """A tokenizer directory that cannot be used; the message says which file and what to do."""


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (bad roles, missing fields, ...)."""


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise TokenizerDirError(f"{path} is missing: point to a Hugging Face checkpoint directory "
                                "that has tokenizer.json and tokenizer_config.json")


def _read_json(path: Path) -> Any:
    _require_file(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerDirError(f"{path} is not valid JSON ({e}): regenerate or re-download it") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _templates(directory: Path, config: dict) -> dict[str, str]:
    """Named chat templates; chat_template.jinja takes priority over the config entry."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    spec = config.get("chat_template")
    if spec is None:
        return {}
    if isinstance(spec, str):
        return {"default": spec}
    if isinstance(spec, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in spec):
        return {t["name"]: t["template"] for t in spec}
    raise TokenizerDirError(f"{directory / 'tokenizer_config.json'}: chat_template must be a string or a list "
                            "of {name, template} entries")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps (jinja's own sorts keys and escapes HTML)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Messages and tools as plain dicts and lists (pydantic objects are dumped)."""
    if callable(getattr(value, "model_dump", None)):
        value = value.model_dump()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _normalise(messages: Sequence[Any]) -> list[dict]:
    """What transformers does before rendering: drop None-valued keys, alias reasoning."""
    out = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be a dict with 'role' and 'content', got {message!r:.80}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _byte_of_char() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable Latin-1 bytes stand for themselves,
    the other bytes (controls, space, ...) for the code points 256, 257, ... in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def _parse_call(inner: str) -> dict | None:
    """One `<tool_call>` body -> {"name", "arguments" (JSON text)}, or None if malformed."""
    body = inner.strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            ok = isinstance(json.loads(args), dict)
        except ValueError:
            ok = False
        return {"name": obj["name"], "arguments": args} if ok else None
    if not isinstance(args, dict):
        return None
    match = _CANONICAL_CALL.fullmatch(body)
    if match:
        try:
            # Keep the model's own text, so that re-rendering the call reproduces its tokens.
            if json.loads(match.group(1)) == obj["name"] and json.loads(match.group(2)) == args:
                return {"name": obj["name"], "arguments": match.group(2)}
        except ValueError:
            pass
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


class ChatTokenizer:
    """Encode, decode and render chats for one checkpoint directory."""

    def __init__(self, tokenizer: Tokenizer, config: dict, templates: dict[str, str],
                 generation_eos: Sequence[int] = (), source: str = "tokenizer"):
        self.tokenizer = tokenizer
        self.config = config
        self.templates = templates
        self.source = source
        self.special_tokens = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k)))}
        texts = {*_TURN_END_TOKENS, self.special_tokens.get("eos_token", "")}
        ids = {tokenizer.token_to_id(t) for t in texts if t}
        self.eos_ids: frozenset[int] = frozenset(i for i in (*ids, *generation_eos) if i is not None)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ChatTokenizer":
        directory = Path(path)
        if directory.suffix == ".gguf" and directory.is_file():
            return cls.from_gguf(directory)
        if directory.is_dir() and not (directory / "tokenizer_config.json").is_file() and find_gguf(directory):
            return cls.from_gguf(find_gguf(directory))
        if not directory.is_dir():
            raise TokenizerDirError(f"{directory} is not a directory: point to a Hugging Face checkpoint directory")
        config = _read_json(directory / "tokenizer_config.json")
        if not isinstance(config, dict):
            raise TokenizerDirError(f"{directory / 'tokenizer_config.json'} must hold a JSON object")
        tokenizer_file = directory / "tokenizer.json"
        _require_file(tokenizer_file)
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises plain Exception for bad files
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerDirError(f"{tokenizer_file} is not a valid tokenizer file ({reason}): "
                                    "regenerate or re-download it") from None
        return cls(tokenizer, config, _templates(directory, config), _generation_eos(directory), str(directory))

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ChatTokenizer":
        """The tokenizer and chat template(s) stored in a GGUF file's metadata."""
        path = Path(path)
        try:
            meta = file_metadata(path)
        except (ValueError, OSError) as e:
            raise TokenizerDirError(f"{path}: not a readable GGUF file ({e})") from None
        tokenizer = _gguf_tokenizer(meta, path)
        token = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown")}
        config = {f"{k}_token": tokenizer.id_to_token(i) for k, i in
                  zip(("bos", "eos", "pad", "unk"), token.values()) if i is not None}
        templates = {n: meta[f"tokenizer.chat_template.{n}"] for n in meta.get("tokenizer.chat_templates", [])}
        if "tokenizer.chat_template" in meta:
            templates["default"] = meta["tokenizer.chat_template"]
        ends = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom") if f"tokenizer.ggml.{k}_token_id" in meta]
        return cls(tokenizer, config, templates, ends, str(path))

    @property
    def vocab_size(self) -> int:
        """Ids 0..vocab_size-1 have a token; a model's embedding may be larger (padding)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str) -> int:
        """The id of one token (e.g. "<|im_end|>"); KeyError if it is not in the vocabulary."""
        token_id = self.tokenizer.token_to_id(text)
        if token_id is None:
            raise KeyError(f"{text!r} is not a token of {self.source}")
        return token_id

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special tokens written in it are matched, no BOS is added. Encoded as a
        batch of one: `tokenizers` keeps the GIL through a single encode (seconds for a prompt of
        megabytes, and every other thread, a server's event loop included, waits), not through a
        batch, whose ids are the same."""
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included; unknown ids are skipped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: Sequence[Any], tools: Sequence[Any] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text, exactly as transformers' `apply_chat_template(tokenize=False)`."""
        template = self._template(tools)
        variables = {**self.special_tokens, **kwargs}
        try:
            return template.render(messages=_normalise(messages), tools=_plain(tools), documents=None,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.source} rejected the conversation: {e}") from None

    def render_ids(self, messages: Sequence[Any], tools: Sequence[Any] | None = None,
                   add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt))

    def render_assistant_output(self, message: Mapping[str, Any], tools: Sequence[Any] | None = None) -> str:
        """The text the template writes for this assistant message after `<|im_start|>assistant\\n`,
        up to and including its end-of-turn token: what a replay forces token by token.

        Taken from the template itself (a rendering with the message minus one without),
        so it cannot drift from the prompts the next turns will be rendered into.
        """
        message = {**_plain(message), "role": "assistant"}
        probe = [{"role": "user", "content": "?"}]
        head = self.apply_chat_template(probe, tools, add_generation_prompt=True)
        full = self.apply_chat_template([*probe, message], tools, add_generation_prompt=False)
        end = self.special_tokens.get("eos_token", "<|im_end|>")
        if not full.startswith(head) or full.rfind(end) < len(head):
            raise ChatTemplateError(f"chat template of {self.source} does not render an assistant turn as "
                                    f"generation prompt + body + {end}; outputs cannot be forced with it")
        return full[len(head):full.rindex(end) + len(end)]

    def parse_assistant_output(self, text: str) -> tuple[str, list[dict]]:
        """Generated text -> (content, OpenAI tool calls). Malformed calls stay in the content.

        The inverse of `render_assistant_output` for text that follows the template: the
        message {"content": content, "tool_calls": calls} renders back to `text`. Call ids
        are deterministic (a hash of the text and the call's index), so replays agree.
        """
        for end in self._end_texts:
            text = text.removesuffix(end)
        pieces, calls, pos = [], [], 0
        for match in _TOOL_CALL.finditer(text):
            function = _parse_call(match.group(1))
            if function is not None:
                pieces.append(text[pos:match.start()])
                calls.append(function)
                pos = match.end()
        if not calls:
            return text.lstrip(), []
        head = pieces[0].removesuffix("\n")
        rest = [p.strip() for p in (*pieces[1:], text[pos:]) if p.strip()]
        content = "\n".join([head, *rest] if head else rest).lstrip()
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return content, [{"id": f"call_{digest}_{i}", "type": "function", "function": f}
                         for i, f in enumerate(calls)]

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    @cached_property
    def token_bytes(self) -> list[bytes] | None:
        """The bytes of every id for byte-level tokenizers (None for others); built on first use."""
        if not isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            return None
        table = _byte_of_char()
        out = []
        for i in range(self.vocab_size):
            token = self.tokenizer.id_to_token(i) or ""
            # Like the ByteLevel decoder: a token outside the alphabet (an added token) is its UTF-8.
            if all(c in table for c in token):
                out.append(bytes(table[c] for c in token))
            else:
                out.append(token.encode("utf-8"))
        return out

    @cached_property
    def _end_texts(self) -> list[str]:
        return [t for i in sorted(self.eos_ids) if (t := self.tokenizer.id_to_token(i))]

    def _template(self, tools: Sequence[Any] | None) -> jinja2.Template:
        name = "tool_use" if tools is not None and "tool_use" in self.templates else "default"
        if name not in self.templates:
            raise ChatTemplateError(f"{self.source} has no chat template: add chat_template to tokenizer_config.json")
        return _compile(self.templates[name])


class StreamDecoder:
    """Ids fed one at a time -> text deltas that never end inside a UTF-8 character.

    Byte-level tokenizers: the bytes of each token go through an incremental UTF-8
    decoder, which holds back an unfinished character and replaces invalid bytes the way
    the full decode does, so the deltas concatenate to `decode(ids)`. Other tokenizers:
    decode a short window of recent ids and hold back text that ends in U+FFFD.
    `flush()` at the end returns what is still held (an unfinished character as U+FFFD).
    """

    def __init__(self, tokenizer: ChatTokenizer):
        self._tokenizer = tokenizer
        self._bytes = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._start = 0  # window start: context so that the next token decodes right
        self._done = 0  # ids up to here have been emitted

    def feed(self, token_id: int) -> str:
        if self._bytes is not None:
            chunk = self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""
            return self._utf8.decode(chunk)
        self._ids.append(token_id)
        return self._window_delta(final=False)

    def flush(self) -> str:
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        return self._window_delta(final=True)

    def _window_delta(self, final: bool) -> str:
        seen = self._tokenizer.decode(self._ids[self._start:self._done])
        text = self._tokenizer.decode(self._ids[self._start:])
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not final):
            return ""
        self._start, self._done = self._done, len(self._ids)
        return text[len(seen):]


def _generation_eos(directory: Path) -> list[int]:
    """eos_token_id of generation_config.json (an int or a list), if the file exists."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    config = _read_json(path)
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    eos = [eos] if isinstance(eos, int) else eos or []
    if not all(isinstance(i, int) for i in eos):
        raise TokenizerDirError(f"{path}: eos_token_id must be an int or a list of ints")
    return list(eos)


def _gguf_tokenizer(meta: dict, path: Path) -> Tokenizer:
    """The `tokenizers` BPE that a GGUF tokenizer describes: vocabulary and merges, control
    tokens as special added tokens, user-defined ones as plain added tokens, and the
    pre-tokenizer llama.cpp's name stands for. The UNUSED `[PAD...]` entries at the end pad
    the vocabulary to the embedding's size (llama.cpp's converter adds them): left out,
    so ids 0..vocab_size-1 are real tokens, as in the checkpoint the file came from."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise TokenizerDirError(f"{path}: GGUF tokenizer model {model!r} is not supported: Ostinato reads "
                                "byte-level BPE tokenizers ('gpt2')")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise TokenizerDirError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (known: "
                                f"{', '.join(GGUF_PRE_TOKENIZERS)}): use the Hugging Face tokenizer directory")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    n = len(tokens)
    while n and types[n - 1] == TokenType.UNUSED:
        n -= 1
    added_types = (TokenType.CONTROL, TokenType.USER_DEFINED)
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": types[i] == TokenType.CONTROL}
                         for i in range(n) if types[i] in added_types],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": GGUF_PRE_TOKENIZERS[pre]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tokens[i]: i for i in range(n) if types[i] not in added_types},
                  "merges": [m.split(" ", 1) for m in meta.get("tokenizer.ggml.merges", [])]},
    }
    return Tokenizer.from_str(json.dumps(spec))
