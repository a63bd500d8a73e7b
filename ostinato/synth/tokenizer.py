"""Train the byte-level BPE tokenizer of synthetic checkpoints and write it in HF format.

No pretrained tokenizer can be downloaded here, yet the engine, the server, transformers
and llama.cpp's converter must all load a real tokenizer directory. So we train one with
`tokenizers`, shaped like Qwen's: a regex split that keeps letters, single digits,
punctuation runs and newlines apart, byte-level mapping (every byte is encodable, no
unknown token), no normaliser, and the control tokens appended after the BPE vocabulary.

Training is bounded: only the first `max_chars` characters of the corpus are used, so a
32k vocabulary trains in seconds, and the same corpus always gives the same files.
"""

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ostinato.synth.chat_template import CHAT_TEMPLATE

# Special (control) tokens; `skip_special_tokens` removes them.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Markup the model writes inside its answers; atomic, but kept when decoding for a user.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

# Contractions, words (with one leading non-letter), single digits, punctuation runs
# (with trailing newlines), newline runs, then other whitespace, keeping the last space
# of a run for the next word.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TokenizerInfo:
    """What a checkpoint writer needs: ids 0..vocab_size-1 are used, the control ids."""

    vocab_size: int
    special_ids: dict[str, int]

    @property
    def eos_id(self) -> int:
        """Ends an assistant turn (config.json's eos_token_id, as in Qwen3)."""
        return self.special_ids["<|im_end|>"]

    @property
    def pad_id(self) -> int:
        return self.special_ids["<|endoftext|>"]

    @property
    def bos_id(self) -> int:
        """config.json's bos_token_id in Qwen3; never prepended to a prompt."""
        return self.special_ids["<|endoftext|>"]

    @property
    def eos_ids(self) -> list[int]:
        """generation_config.json's eos_token_id: either token ends generation."""
        return [self.eos_id, self.pad_id]


def _capped(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """The corpus up to `max_chars` characters (the last text is cut), in order."""
    left = max_chars
    for text in texts:
        if left <= 0:
            return
        yield text[:left]
        left -= len(text)


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict]:
    """The `added_tokens_decoder` block, in the form transformers writes it."""
    out = {}
    for content in CONTROL_TOKENS + MARKUP_TOKENS:
        out[str(tok.token_to_id(content))] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": content in CONTROL_TOKENS,
        }
    return out


def _tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict:
    return {
        "added_tokens_decoder": _added_tokens_decoder(tok),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path, *,
                    max_chars: int = 16_000_000, model_max_length: int = 131072) -> TokenizerInfo:
    """Train on the first `max_chars` characters of `texts` and write the tokenizer files.

    `vocab_size` counts the added tokens too; a corpus with too few distinct pairs gives
    a smaller vocabulary (the returned `vocab_size` is the one actually used).
    """
    n_added = len(CONTROL_TOKENS) + len(MARKUP_TOKENS)
    if vocab_size < 256 + n_added + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: byte-level BPE needs at least {256 + n_added + 1}")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(_capped(texts, max_chars), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    config = _tokenizer_config(tok, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_ids = {t: tok.token_to_id(t) for t in CONTROL_TOKENS + MARKUP_TOKENS}
    return TokenizerInfo(vocab_size=tok.get_vocab_size(with_added_tokens=True), special_ids=special_ids)
