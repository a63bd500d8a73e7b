"""Tool-call and reasoning parsers, one per model family, behind one interface.

`Family` is what a served model writes: its tool-call format (chosen from the chat
template's markup, or by `--tool-call-parser`) and whether it thinks in `<think>` tags.
Per request it builds an `OutputParser` over the request's declared tools.
"""
from __future__ import annotations

from dataclasses import dataclass

from ostinato.server.parsing.base import THINK_CLOSE, Block, Delta, OutputParser, ToolFormat
from ostinato.server.parsing.deepseek import CALLS_BEGIN, DeepSeekV3, DeepSeekV31
from ostinato.server.parsing.harmony import Harmony
from ostinato.server.parsing.hermes import Hermes
from ostinato.server.parsing.qwen3_coder import Qwen3Coder

FORMATS: dict[str, type[ToolFormat] | None] = {
    "hermes": Hermes, "qwen3_coder": Qwen3Coder, "harmony": Harmony, "deepseek_v3": DeepSeekV3,
    "deepseek_v31": DeepSeekV31, "none": None}

__all__ = ["FORMATS", "Block", "Delta", "Family", "OutputParser", "ToolFormat", "detect_format"]


def detect_format(template: str) -> str:
    """The tool-call format a chat template teaches, from the markup it writes."""
    if CALLS_BEGIN in template:  # V3 fences the arguments as JSON; V3.1 writes them bare
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    return "none"


@dataclass(frozen=True)
class Family:
    tool_format: str  # a key of FORMATS
    thinks: bool  # reasoning in <think>...</think>

    @classmethod
    def of(cls, tokenizer, override: str | None = None) -> "Family":
        template = "\n".join(tokenizer.templates.values())
        fmt = override or detect_format(template)
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call parser {fmt!r} (known: {', '.join(FORMATS)})")
        thinks = THINK_CLOSE in template or tokenizer.tokenizer.token_to_id(THINK_CLOSE) is not None
        return cls(fmt, thinks)

    def parser(self, tools: dict[str, dict] | None, in_reasoning: bool = False) -> OutputParser:
        """`tools`: the request's declared functions (name -> parameters schema); None: no tool
        parsing (harmony still reads its channels)."""
        kind = FORMATS[self.tool_format]
        fmt = kind(tools or {}) if kind is not None and (tools or kind.reasons) else None
        return OutputParser(fmt, reasoning=self.thinks, in_reasoning=in_reasoning)
