"""Session format, converters of the recorded workloads, the split and the embedded generator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from ostinato.sessions.converters import convert
from ostinato.sessions.read import load_sessions, split_sessions
from ostinato.sessions.turns import (
    KINDS, Session, SessionFormatError, Turn, read_jsonl, session_from_json, session_to_json, write_jsonl,
)
from ostinato.sessions.stats import FAMILIES, QUANTILE_LEVELS, load_stats, measure_stats
from ostinato.sessions.synthetic import generate_sessions
from ostinato.sessions.text import session_texts

WORKLOADS = Path(__file__).parents[1].parent / "shared" / "workloads"
EXPECTED = {  # sessions per file, from the workloads README
    "tau2/gpt-4.1_airline.json": 20, "tau2/gpt-4.1_retail.json": 40, "tau2/gpt-4.1_telecom.json": 40,
    "tau2/sft-gpt-4.1_airline.json": 20, "tau2/sft-gpt-4.1_retail.json": 40,
    "tau2/sft-gpt-4.1_telecom.json": 40, "tau-bench/gpt-4o-airline.json": 200,
}


def workload(relative: str) -> Path:
    path = WORKLOADS / relative
    if not path.exists():
        pytest.skip(f"recorded workloads not found at {path}")
    return path


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[Session]]:
    return {family: load_sessions(workload(family)) for family in FAMILIES}


@pytest.mark.parametrize("relative", sorted(EXPECTED))
def test_every_json_workload_converts(relative: str) -> None:
    sessions = load_sessions(workload(relative))
    assert len(sessions) == EXPECTED[relative]
    assert all(s.turns for s in sessions)


def test_every_swe_agent_trajectory_converts() -> None:
    files = sorted(workload("swe-agent").glob("*.traj"))
    assert len(files) == 22
    for file in files:
        (session,) = load_sessions(file)
        assert session.source == "swe-agent" and len(session.turns) >= 4, file.name


@pytest.mark.parametrize("family", FAMILIES)
def test_turns_are_requests_with_recorded_outputs(recorded: dict, family: str) -> None:
    for s in recorded[family]:
        assert s.turns[0].kind == "first"
        for i, turn in enumerate(s.turns):
            assert turn.output["role"] == "assistant" and turn.kind in KINDS
            sent = turn.messages
            assert sent and all(isinstance(m["content"], str) for m in sent + [turn.output])
            assert s.conversations[0][turn.n_sent] is turn.output
            if i and family != "swe-agent":
                assert turn.kind == ("tool" if sent[-1]["role"] == "tool" else "user")
                assert {m["role"] for m in s.new_messages(i)} == {turn.kind}
            elif i:
                assert turn.kind == "tool"  # observations, as tool or as user messages
        assert len(s.conversations) == 1  # stored once, not once per turn


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_calls_and_tool_messages_are_linked(recorded: dict, family: str) -> None:
    for s in recorded[family]:
        names = {t["function"]["name"] for t in s.tools or []}
        calls: dict[str, str] = {}
        for msg in s.conversations[0]:
            for call in msg.get("tool_calls") or []:
                assert call["id"] and call["type"] == "function"
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
                assert call["function"]["name"] in names
                calls[call["id"]] = call["function"]["name"]
            if msg["role"] == "tool":
                assert calls[msg["tool_call_id"]] == msg["name"]


def test_tau2_is_the_agents_view(recorded: dict) -> None:
    for s in recorded["tau2"]:
        first = s.turns[0].messages
        assert [m["role"] for m in first] == ["system", "assistant", "user"]
        assert "<policy>" in first[0]["content"]
        assert not any(m["role"] == "user" and m.get("tool_calls") for m in s.conversations[0])
    telecom = [s for s in recorded["tau2"] if s.source == "tau2/telecom"]
    assert len(telecom) == 80 and len({s.task for s in telecom}) == 40


def test_inferred_schemas_type_the_arguments(recorded: dict) -> None:
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in recorded["tau-bench"][0].tools}
    assert tools["get_user_details"]["properties"]["user_id"] == {"type": "string"}
    assert "user_id" in tools["get_user_details"]["required"]
    swe = {s.id.split("/")[-1]: s for s in recorded["swe-agent"]}
    fc = swe["marshmallow-1867__function_calling__install-1"].tools
    edit = next(t for t in fc if t["function"]["name"] == "edit")["function"]["parameters"]
    assert edit["properties"]["start_line"] == {"type": "integer"}
    assert swe["ctf__crypto__eps"].tools is None


def test_swe_agent_tasks_group_configurations(recorded: dict) -> None:
    tasks = {s.id.split("/")[-1]: s.task for s in recorded["swe-agent"]}
    assert len({t for name, t in tasks.items() if name.startswith("marshmallow-1867")}) == 1
    assert len(set(tasks.values())) == 13


def test_jsonl_round_trip(recorded: dict, tmp_path: Path) -> None:
    sessions = recorded["tau2"][:5] + recorded["swe-agent"][:3] + generate_sessions(6, 1) + [_forked_session()]
    path = tmp_path / "sessions.jsonl"
    write_jsonl(sessions, path)
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(sessions)
    assert read_jsonl(path) == sessions
    assert load_sessions(str(path)) == sessions


def _forked_session() -> Session:
    """Hand-built turns where the second request does not extend the first."""
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    answer = {"role": "assistant", "content": "hello"}
    retry = {"role": "user", "content": "again, shorter"}
    shorter = {"role": "assistant", "content": "hi"}
    turns = [Turn([system, user], answer, "first"), Turn([system, retry], shorter, "user")]
    return Session("hand/1", "t1", "hand", None, turns)


def test_turns_that_do_not_extend_start_a_new_conversation() -> None:
    s = _forked_session()
    assert len(s.conversations) == 2
    assert s.turns[1].messages[1]["content"] == "again, shorter"
    assert [m["content"] for m in s.new_messages(1)] == ["again, shorter"]


_message = hs.fixed_dictionaries({"role": hs.sampled_from(["user", "tool"]), "content": hs.text(max_size=20)})


@settings(max_examples=40, deadline=None)
@given(hs.lists(hs.tuples(hs.lists(_message, min_size=1, max_size=3), hs.text(max_size=10)), min_size=1, max_size=6))
def test_sessions_store_linear_history_and_round_trip(steps: list) -> None:
    conversation: list[dict] = [{"role": "system", "content": "s"}]
    turns = []
    for new, reply in steps:
        conversation = conversation + new
        output = {"role": "assistant", "content": reply}
        turns.append(Turn(conversation, output, "first" if not turns else "user"))
        conversation = conversation + [output]
    s = Session("h", "t", "prop", None, turns)
    assert len(s.conversations) == 1 and len(s.conversations[0]) == len(conversation)
    assert [t.messages for t in s.turns] == [t.messages for t in turns]
    assert [len(s.new_messages(i)) for i in range(1, len(turns))] == [len(n) for n, _ in steps[1:]]
    assert session_from_json(json.loads(json.dumps(session_to_json(s)))) == s


def test_split_is_by_task_and_deterministic(recorded: dict) -> None:
    sessions = [s for family in FAMILIES for s in recorded[family]]
    dev, held = split_sessions(sessions)
    assert split_sessions(sessions) == (dev, held)
    assert len(dev) + len(held) == len(sessions)
    assert not {(s.source, s.task) for s in dev} & {(s.source, s.task) for s in held}
    for source in {s.source for s in sessions}:
        assert any(s.source == source for s in dev) and any(s.source == source for s in held)
    assert split_sessions(sessions, seed=1) != (dev, held)
    everything, nothing = split_sessions(sessions, held_out_fraction=0.0)
    assert len(everything) == len(sessions) and not nothing


def test_split_is_stable_across_processes() -> None:
    code = ("from ostinato.sessions.read import split_sessions;"
            "from ostinato.sessions.synthetic import generate_sessions;"
            "print([s.id for s in split_sessions(generate_sessions(30, 0), 0.5, seed=7)[1]])")
    outputs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                cwd=Path(__file__).parents[1], check=True)
        outputs.add(result.stdout)
    local = [s.id for s in split_sessions(generate_sessions(30, 0), 0.5, seed=7)[1]]
    assert outputs == {f"{local}\n"}


def test_generator_is_deterministic() -> None:
    a = generate_sessions(12, seed=3)
    assert a == generate_sessions(12, seed=3)
    assert a[:5] == generate_sessions(5, seed=3)
    assert a != generate_sessions(12, seed=4)
    assert [s.source for s in a[:3]] == [f"{f}/synthetic" for f in FAMILIES]
    assert len({s.task for s in a}) == 12


def test_generated_sessions_are_well_formed() -> None:
    for s in generate_sessions(30, seed=2):
        assert s.turns[0].kind == "first" and len(s.conversations) == 1
        for i, turn in enumerate(s.turns[1:], 1):
            roles = {m["role"] for m in s.new_messages(i)}
            assert roles == ({"tool"} if turn.kind == "tool" else {"user"}) or s.source.startswith("swe-agent")
            assert turn.output["role"] == "assistant"
        names = {t["function"]["name"] for t in s.tools or []}
        for call in (c for t in s.turns for c in t.output.get("tool_calls") or []):
            assert call["function"]["name"] in names
            json.loads(call["function"]["arguments"])


def test_generator_follows_measured_statistics() -> None:
    """Medians within 30% of the recordings (or, for bimodal ones such as tau2's first
    turn, inside the recordings' 35th-65th percentiles); tool-call shares within 0.1."""
    measured = load_stats()["families"]
    generated = measure_stats(generate_sessions(150, seed=0))
    lo, hi = QUANTILE_LEVELS.index(0.35), QUANTILE_LEVELS.index(0.65)

    def close(ours: list[float], real: list[float]) -> bool:
        median = ours[len(ours) // 2]
        return abs(median / real[len(real) // 2] - 1) <= 0.3 or real[lo] <= median <= real[hi]

    for family, real in measured.items():
        ours = generated[family]
        assert close(ours["turns_per_session"], real["turns_per_session"]), family
        for kind, q in real["new_chars"].items():
            assert close(ours["new_chars"][kind], q), (family, kind)
        for kind, q in real["output_chars"].items():
            assert close(ours["output_chars"][kind], q), (family, kind)
        assert abs(ours["tool_call_share"] - real["tool_call_share"]) <= 0.1, family


def test_shipped_statistics_match_the_workloads(recorded: dict) -> None:
    stats = load_stats()
    assert {s["path"] for s in stats["sources"]} == {
        p.relative_to(WORKLOADS).as_posix() for p in WORKLOADS.rglob("*") if p.suffix in (".json", ".traj")}
    assert measure_stats(s for family in FAMILIES for s in recorded[family]) == stats["families"]
    assert stats["measured_on"] and stats["families"]["tau2"]["turns_per_session"][10] > 5


def test_load_sessions_specs(tmp_path: Path) -> None:
    assert len(load_sessions("embedded")) == 30
    assert load_sessions("embedded:6:1") == generate_sessions(6, 1)
    assert len(load_sessions("embedded:4")) == 4
    folder = tmp_path / "mixed" / "nested"
    folder.mkdir(parents=True)
    write_jsonl(generate_sessions(3, 5), folder / "a.jsonl")
    (folder / "notes.json").write_text('{"unrelated": true}')
    (folder / "README.md").write_text("not a session")
    assert load_sessions(tmp_path / "mixed") == generate_sessions(3, 5)


def test_load_sessions_on_each_recorded_kind() -> None:
    assert len(load_sessions(str(workload("tau2/gpt-4.1_airline.json")))) == 20
    assert len(load_sessions(str(workload("tau-bench/gpt-4o-airline.json")))) == 200
    assert len(load_sessions(str(workload("swe-agent/ctf__crypto__eps.traj")))) == 1
    assert len(load_sessions(str(WORKLOADS))) == 422


@pytest.mark.parametrize("spec", ["missing/file.jsonl", "embedded:x", "embedded:1:2:3"])
def test_bad_specs_fail_with_one_clear_line(spec: str) -> None:
    with pytest.raises(SessionFormatError) as error:
        load_sessions(spec)
    assert "\n" not in str(error.value) and "embedded" in str(error.value)


def test_bad_files_fail_with_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text('{"unrelated": true}')
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "bad.jsonl").write_text('{"format": "something else"}\n')
    (tmp_path / "empty").mkdir()
    for name in ("other.json", "broken.json", "bad.jsonl", "empty"):
        with pytest.raises(ValueError) as error:
            load_sessions(tmp_path / name)
        assert isinstance(error.value, SessionFormatError) and "\n" not in str(error.value)
        assert name in str(error.value)


def test_session_texts_cover_contents_and_calls() -> None:
    sessions = generate_sessions(6, 0)
    texts = list(session_texts(sessions))
    contents = [m["content"] for s in sessions for c in s.conversations for m in c if m["content"]]
    calls = [c for s in sessions for t in s.turns for c in t.output.get("tool_calls") or []]
    assert len(texts) == len(contents) + len(calls) + sum(1 for s in sessions if s.tools)
    call_texts = [json.loads(t) for t in texts if t.startswith('{"name"')]
    assert {c["name"] for c in call_texts} == {c["function"]["name"] for c in calls}


def test_converters_normalise_content_parts_and_invent_ids() -> None:
    traj = [{"role": "system", "content": [{"type": "text", "text": "policy "}, {"type": "text", "text": "text"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "look", "arguments": {"q": 1}}}]},
            {"role": "tool", "content": "found"},
            {"role": "assistant", "content": "done"}]
    (s,) = convert([{"task_id": 3, "trial": 1, "traj": traj}], "model-shop")
    first, second = s.turns
    assert first.messages[0]["content"] == "policy text" and first.output["content"] == ""
    call = first.output["tool_calls"][0]
    assert call["id"] and json.loads(call["function"]["arguments"]) == {"q": 1}
    assert second.kind == "tool" and second.messages[-1]["tool_call_id"] == call["id"]
    assert second.messages[-1]["name"] == "look"
    assert (s.source, s.task) == ("tau-bench/shop", "3")
    assert convert([{"task_id": 3, "trial": 1, "traj": traj}], "model-shop") == [s]


def test_swe_agent_run_without_history_uses_its_steps() -> None:
    steps = [{"response": f"step {i}\n```\nls\n```", "observation": f"out {i}"} for i in range(3)]
    (s,) = convert({"trajectory": steps}, "old-run")
    assert [t.kind for t in s.turns] == ["first", "tool", "tool"]
    assert s.turns[2].messages[-1]["content"] == "out 1"
