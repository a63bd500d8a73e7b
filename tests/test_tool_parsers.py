"""Tool-call and reasoning parsers on crafted text: the one-shot parse is what each
family's markup means, and the deltas of every split of the text add up to it."""
from __future__ import annotations

import json
import logging

import pytest

from ostinato.server.parsing import FORMATS, Family, OutputParser, detect_format
from ostinato.server.parsing.qwen3_coder import convert

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                             "metric": {"type": "boolean"}, "hours": {"type": "array"},
                                             "ratio": {"type": "number"}}}
TOOLS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
DS = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"

CASES = {  # name: (format, reasoning, text, expected blocks as (kind, text, name))
    "hermes": ("hermes", True,
               '<think>\nLet me think.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
               '</tool_call>',
               [("reasoning", "Let me think.", ""), ("text", "Let me check.", ""),
                ("call", '{"city": "Paris", "days": 2}', "get_weather"), ("call", "{}", "get_time")]),
    "hermes_undeclared": ("hermes", False,
                          'A <tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call> B',
                          [("text", 'A <tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call> B',
                            "")]),
    "hermes_other_layout": ("hermes", False,
                            '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>',
                            [("call", '{"city": "Oslo"}', "get_weather")]),
    "hermes_malformed": ("hermes", False, 'x <tool_call>{"name": get_weather}</tool_call>',
                         [("text", 'x <tool_call>{"name": get_weather}</tool_call>', "")]),
    "hermes_truncated": ("hermes", False, 'ok\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
                         [("text", "ok", ""), ("call", '{"city": "Pa', "get_weather")]),
    "qwen3_coder": ("qwen3_coder", False,
                    "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n"
                    "[1, 2]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n</tool_call>",
                    [("text", "I will look.", ""),
                     ("call", '{"city": "San Francisco", "days": 3, "metric": true, "hours": [1, 2], "ratio": 0.5}',
                      "get_weather")]),
    "qwen3_coder_multiline": ("qwen3_coder", True,
                              "<think>ok</think><tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\n"
                              "\"quoted\"\n</parameter>\n<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call>",
                              [("reasoning", "ok", ""),
                               ("call", '{"city": "line 1\\n\\"quoted\\"", "days": "many"}', "get_weather")]),
    "qwen3_coder_undeclared": ("qwen3_coder", False,
                               "<tool_call>\n<function=launch>\n<parameter=x>\n1\n</parameter>\n</function>\n"
                               "</tool_call>",
                               [("text", "<tool_call>\n<function=launch>\n<parameter=x>\n1\n</parameter>\n"
                                         "</function>\n</tool_call>", "")]),
    "harmony": ("harmony", False,
                "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}<|call|>',
                [("reasoning", "User wants weather.", ""), ("call", '{"city": "Tokyo"}', "get_weather")]),
    "harmony_final": ("harmony", False,
                      "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"
                      "It is sunny.",
                      [("reasoning", "Think.", ""), ("text", "It is sunny.", "")]),
    "harmony_recipient_first": ("harmony", False,
                                "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}",
                                [("call", "{}", "get_time")]),
    "harmony_undeclared": ("harmony", False,
                           "<|channel|>commentary to=functions.wipe <|constrain|>json<|message|>{}<|call|>",
                           [("text", "<|channel|>commentary to=functions.wipe <|constrain|>json<|message|>{}", "")]),
    "deepseek_v3": ("deepseek_v3", False,
                    f"Checking.{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n{{\"city\": \"Lima\"}}\n```{DS[3]}"
                    f"{DS[1]}function{DS[2]}get_time\n```json\n{{}}\n```{DS[3]}{DS[4]}",
                    [("text", "Checking.", ""), ("call", '{"city": "Lima"}', "get_weather"), ("call", "{}", "get_time")]),
    "deepseek_undeclared": ("deepseek_v3", True,
                            f"<think>hm</think>{DS[0]}{DS[1]}function{DS[2]}nuke\n```json\n{{}}\n```{DS[3]}{DS[4]}",
                            [("reasoning", "hm", ""), ("text", f"{DS[1]}function{DS[2]}nuke\n```json\n{{}}\n```{DS[3]}", "")]),
    "plain_with_reasoning": ("none", True, "<think>\na\n\nb\n</think>\n\nanswer <b>", [("reasoning", "a\n\nb", ""),
                                                                                     ("text", "answer <b>", "")]),
    "unclosed_reasoning": ("none", True, "<think>still going", [("reasoning", "still going", "")]),
    "no_reasoning": ("hermes", True, "  just text <thin", [("text", "  just text <thin", "")]),
}


def make(fmt: str, thinks: bool, in_reasoning: bool = False) -> OutputParser:
    kind = FORMATS[fmt]
    return OutputParser(kind(TOOLS) if kind else None, reasoning=thinks, in_reasoning=in_reasoning)


def run(parser: OutputParser, pieces: list[str]) -> list[tuple[str, str, str]]:
    """Feed the pieces and rebuild the blocks from the deltas alone."""
    blocks: dict[int, list] = {}
    for d in [d for p in pieces for d in parser.feed(p)] + parser.finish():
        if d.new:
            assert d.block not in blocks
            blocks[d.block] = [d.kind, "", d.name]
        blocks[d.block][1] += d.text
    return [tuple(blocks[i]) for i in sorted(blocks)]


@pytest.mark.parametrize("case", CASES)
def test_one_shot_parse(case):
    fmt, thinks, text, want = CASES[case]
    assert run(make(fmt, thinks), [text]) == want
    for kind, args, _ in want:
        if kind == "call" and case != "hermes_truncated":
            json.loads(args)


@pytest.mark.parametrize("case", CASES)
def test_every_split_gives_the_one_shot_parse(case, caplog):
    fmt, thinks, text, want = CASES[case]
    with caplog.at_level(logging.WARNING):
        for i in range(len(text) + 1):
            assert run(make(fmt, thinks), [text[:i], text[i:]]) == want, i
        assert run(make(fmt, thinks), list(text)) == want
    assert not caplog.records  # no block ever had to change what it had sent


def test_arguments_stream_before_the_call_ends():
    p = make("hermes", False)
    p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    [call] = p.blocks
    assert (call.kind, call.name, call.text) == ("call", "get_weather", '{"city": "Par')
    q = make("qwen3_coder", False)
    q.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fr")
    assert q.blocks[0].text == '{"city": "San Fr'


def test_reasoning_opened_by_the_prompt():
    p = make("hermes", True, in_reasoning=True)
    assert run(p, ["I should call.\n</think>\n\n", "Done."]) == [("reasoning", "I should call.", ""),
                                                                  ("text", "Done.", "")]
    assert run(make("none", True, in_reasoning=False), ["I should call.</think>x"]) == \
        [("text", "I should call.</think>x", "")]


def test_call_ids_are_deterministic():
    text = CASES["hermes"][2]
    keys = []
    for _ in range(2):
        p = make("hermes", True)
        keys.append([d.key for d in [*p.feed(text[:50]), *p.feed(text[50:]), *p.finish()] if d.new and d.kind == "call"])
    assert keys[0] == keys[1] and len(set(keys[0])) == 2


@pytest.mark.parametrize("value,kind,want", [("3", "integer", "3"), ("x", "integer", '"x"'), ("2.5", "number", "2.5"),
                                             ("4", "number", "4"), ("FALSE", "boolean", "false"),
                                             ('{"a": 1}', "object", '{"a": 1}'), ("[1", "array", '"[1"'),
                                             ("null", "integer", "null"), (" a ", "string", '" a "'),
                                             ("7", None, '"7"')])
def test_qwen3_coder_value_conversion(value, kind, want):
    assert convert(value, kind) == want


class _Tok:
    def __init__(self, template):
        self.templates = {"default": template}

        class _T:
            @staticmethod
            def token_to_id(t):
                return None
        self.tokenizer = _T()


def test_format_detection_and_override():
    assert detect_format("{{'<tool_call>'}}") == "hermes"
    assert detect_format("<tool_call>\n<function=x>\n<parameter=y>") == "qwen3_coder"
    assert detect_format("<|start|>assistant<|channel|>final<|message|>") == "harmony"
    assert detect_format("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert detect_format("plain") == "none"
    assert Family.of(_Tok("<tool_call></think>")) == Family("hermes", True)
    assert Family.of(_Tok("<tool_call>"), "qwen3_coder") == Family("qwen3_coder", False)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        Family.of(_Tok(""), "llama3_json")
    assert Family("hermes", False).parser(None).fmt is None  # no tools declared: no tool parsing
    assert Family("harmony", False).parser(None).fmt is not None  # harmony still reads its channels
