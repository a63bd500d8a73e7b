"""Tool-call and reasoning parsers on crafted text: the one-shot parse is what each
family's markup means, and the deltas of every split of the text add up to it. The
steering that writes into an output (a required call, one call at most, a reasoning
budget) runs over a scripted model, one character a token, in each format."""
from __future__ import annotations

import json
import logging
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ostinato.server.parsing import FORMATS, Family, OutputParser, detect_format
from ostinato.server.parsing.qwen3_coder import convert
from ostinato.server.steering import Asked, Steering

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
    "deepseek_v31": ("deepseek_v31", True,
                     f"<think>Two calls.</think>Checking.{DS[0]}{DS[1]}get_weather{DS[2]}{{\"city\": \"Lima\", "
                     f"\"days\": 3}}{DS[3]}{DS[1]}get_time{DS[2]}{{}}{DS[3]}{DS[4]}",
                     [("reasoning", "Two calls.", ""), ("text", "Checking.", ""),
                      ("call", '{"city": "Lima", "days": 3}', "get_weather"), ("call", "{}", "get_time")]),
    "deepseek_v31_undeclared": ("deepseek_v31", False,
                                f"{DS[0]}{DS[1]}nuke{DS[2]}{{\"all\": true}}{DS[3]}\n{DS[1]}get_time{DS[2]} {{}} "
                                f"{DS[3]}{DS[4]}\nDone.",
                                [("text", f"{DS[1]}nuke{DS[2]}{{\"all\": true}}{DS[3]}", ""),
                                 ("call", "{}", "get_time"), ("text", "Done.", "")]),
    "deepseek_v31_fenced": ("deepseek_v31", False,
                            f"{DS[0]}{DS[1]}get_weather{DS[2]}```json\n{{\"city\": \"Oslo\"}}\n```{DS[3]}{DS[4]}",
                            [("call", '{"city": "Oslo"}', "get_weather")]),
    "deepseek_v31_v3_markup": ("deepseek_v31", False,  # V3's type-first call is not V3.1's: text
                               f"{DS[0]}{DS[1]}function{DS[2]}get_time\n```json\n{{}}\n```{DS[3]}{DS[4]}",
                               [("text", f"{DS[1]}function{DS[2]}get_time\n```json\n{{}}\n```{DS[3]}", "")]),
    "deepseek_v31_truncated": ("deepseek_v31", False, f"ok{DS[0]}{DS[1]}get_weather{DS[2]}{{\"city\": \"Li",
                               [("text", "ok", ""), ("call", '{"city": "Li', "get_weather")]),
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
        if kind == "call" and not case.endswith("_truncated"):
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
    d = make("deepseek_v31", False)
    d.feed(f"Sure.{DS[0]}{DS[1]}get_wea")
    assert [b.kind for b in d.blocks] == ["text"]  # the name is not known before the separator
    deltas = d.feed(f"ther{DS[2]}{{\"city\": \"Li")
    assert [(x.kind, x.name, x.text, x.new) for x in deltas] == [("call", "get_weather", '{"city": "Li', True)]
    deltas = d.feed(f"ma\"}}{DS[3][:5]}")  # a partial end marker is held back
    assert [(x.text, x.new) for x in deltas] == [('ma"}', False)]


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
    v3 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n' + '```json'"
    v31 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments + '<｜tool▁call▁end｜>'"
    assert detect_format(v3) == "deepseek_v3" and detect_format(v31) == "deepseek_v31"
    assert detect_format("plain") == "none"
    assert Family.of(_Tok("<tool_call></think>")) == Family("hermes", True)
    assert Family.of(_Tok("<tool_call>"), "qwen3_coder") == Family("qwen3_coder", False)
    assert Family.of(_Tok("</think>"), "deepseek_v31") == Family("deepseek_v31", True)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        Family.of(_Tok(""), "llama3_json")
    assert Family("hermes", False).parser(None).fmt is None  # no tools declared: no tool parsing
    assert Family("harmony", False).parser(None).fmt is not None  # harmony still reads its channels


def test_the_parser_flag_takes_every_format():
    from ostinato.cli import build_parser

    for name in FORMATS:
        a = build_parser().parse_args(["serve", "--model", "synth:tiny", "--tool-call-parser", name])
        assert a.tool_call_parser == name
    assert "deepseek_v31" in FORMATS


def steered(steering: Steering, model: str, limit: int = 400) -> str:
    """The engine worker's loop over a 'model' that writes `model` one character a token and
    does not read what was written for it -> the output's text."""
    out, insert, script = "", deque(steering.after("", 0)), iter(model)
    for tokens in range(1, limit + 1):
        piece = chr(insert.popleft()) if insert else next(script, None)
        if piece is None:
            break
        out += piece
        if not insert:
            more = steering.after(out, tokens)
            if more is None:
                break
            insert.extend(more)
    return out


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


CONTINUATIONS = {  # format: (what a model writes after a named head, after an unnamed one)
    "hermes": ('"city": "Lima"}}\n</tool_call>', 'get_time", "arguments": {}}\n</tool_call>'),
    "qwen3_coder": ("<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>",
                    "get_time>\n</function>\n</tool_call>"),
    "deepseek_v3": (f'"city": "Lima"}}\n```{DS[3]}{DS[4]}', f"get_time\n```json\n{{}}\n```{DS[3]}{DS[4]}"),
    "deepseek_v31": (f'"city": "Lima"}}{DS[3]}{DS[4]}', f"get_time{DS[2]}{{}}{DS[3]}{DS[4]}"),
    "harmony": ('"city": "Lima"}', "get_time <|constrain|>json<|message|>{}"),
}


@pytest.mark.parametrize("fmt", CONTINUATIONS)
def test_a_required_call_is_written_in_each_format(fmt):
    named, unnamed = CONTINUATIONS[fmt]
    family = Family(fmt, False)
    out = steered(Steering(Asked(call=True, name="get_weather"), family, chars, False), named)
    assert out == FORMATS[fmt].head("get_weather") + named
    assert run(make(fmt, False), [out]) == [("call", '{"city": "Lima"}', "get_weather")]
    out = steered(Steering(Asked(call=True), family, chars, False), unnamed)
    assert run(make(fmt, False), [out]) == [("call", "{}", "get_time")]


def test_a_required_call_follows_the_reasoning_the_prompt_opened():
    family, head = Family("hermes", True), FORMATS["hermes"].head(None)
    model = "Which tool?\n</think>" + 'get_time", "arguments": {}}\n</tool_call>'
    out = steered(Steering(Asked(call=True), family, chars, in_reasoning=True), model)
    assert out == "Which tool?\n</think>" + head + model.split("</think>")[1]
    assert run(make("hermes", True, in_reasoning=True), [out]) == [("reasoning", "Which tool?", ""),
                                                                   ("call", "{}", "get_time")]
    # the prompt did not open it: the call comes first, the model does not get to think
    assert steered(Steering(Asked(call=True), family, chars, False), "<think>").startswith(head)


def test_one_call_at_most_ends_the_output_after_the_first():
    two = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_time"'
    reasoned = "<think>I could write </tool_call> here.</think>" + two
    for thinks, model in ((False, two), (True, reasoned)):
        out = steered(Steering(Asked(single=True), Family("hermes", thinks), chars, False), model)
        assert out == model[:model.index("</tool_call>", model.index("</think>") + 1 if thinks else 0) + 12]
    assert steered(Steering(Asked(), Family("hermes", False), chars, False), two) == two


def test_a_reasoning_budget_closes_the_reasoning_once_spent():
    family = Family("hermes", True)
    out = steered(Steering(Asked(budget=10), family, chars, in_reasoning=True), "x" * 30)
    assert out == "x" * 10 + "\n</think>\n\n" + "x" * 20
    assert run(make("hermes", True, in_reasoning=True), [out]) == [("reasoning", "x" * 10, ""), ("text", "x" * 20, "")]
    opened = steered(Steering(Asked(budget=10), family, chars, False), "<think>" + "y" * 30)  # opened by the model
    assert opened == "<think>yyy\n</think>\n\n" + "y" * 27
    short = "a</think>b" + "c" * 30  # the model closed it within the budget: nothing is written
    assert steered(Steering(Asked(budget=10), family, chars, in_reasoning=True), short) == short
    analysis = "<|channel|>analysis<|message|>" + "z" * 30
    out = steered(Steering(Asked(budget=40), Family("harmony", False), chars, False), analysis)
    assert out == analysis[:40] + "<|end|><|start|>assistant" + analysis[40:]
    both = steered(Steering(Asked(call=True, name="get_time", budget=4), family, chars, True), "w" * 10)
    assert both == "wwww\n</think>\n\n" + FORMATS["hermes"].head("get_time") + "w" * 6


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["a", " ", "<think>", "</think>", "<tool_call>", "</tool_call>", "</", "think>",
                                 "tool_call>", "{}", "\n"]), max_size=14),
       st.integers(1, 5), st.booleans(), st.integers(0, 6))
def test_steering_scans_only_what_is_new(pieces, step, in_reasoning, budget):
    """Steering's searches go on from where they stopped (the output only grows): fed the text a
    few characters at a time, it answers each call as a Steering that sees only that prefix,
    fresh, would."""
    text = "".join(pieces)
    asked = Asked(call=False, single=True, budget=budget)
    family = Family("hermes", True)

    def encode(s):
        return [ord(c) for c in s]

    live = Steering(asked, family, encode, in_reasoning)
    for n in range(0, len(text) + 1, step):
        fresh = Steering(asked, family, encode, in_reasoning)
        fresh.closed = live.closed  # the state its earlier answers left
        want, got = fresh.after(text[:n], n), live.after(text[:n], n)
        assert got == want, (text[:n], got, want)
        if got is None:
            break
