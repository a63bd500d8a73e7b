"""Several conversations: side requests between an agent's turns do not cost it a prefill.

An interleaved workload (a main session of several turns, a side request after each) runs
on the tiny checkpoint with and without saved conversations; the cached-token rate of
the main session's turns after the first is high with them and low without, and every
output is the same either way (greedy: the restored KV is the KV a prefill would write).
"""
from __future__ import annotations

import httpx
import pytest

from ostinato.engine.factory import load_engine
from ostinato.engine.runner import RunnerSettings
from ostinato.engine.sampling import SamplingParams
from ostinato.engine.session import GenerationStats
from ostinato.server.app import build_app
from tests.test_server import LiveServer

SYSTEM = list(range(10, 60))  # a system prompt every request shares
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return load_engine(str(tiny_dir), RunnerSettings(device="cpu", max_context=2048)).engine


def run(engine, prompt, params=GREEDY):
    stats = GenerationStats()
    return list(engine.generate(prompt, params, stats=stats)), stats


def interleaved(engine, keep: int, turns: int = 5, sides: int = 1):
    """-> (outputs, main stats, side stats) of a main session with `sides` side requests per turn."""
    engine.reset()
    engine.keep_conversations(keep)
    main, outputs, main_stats, side_stats = SYSTEM + list(range(100, 300)), [], [], []
    for turn in range(turns):
        out, stats = run(engine, main)
        outputs.append(out)
        main_stats.append(stats)
        for s in range(sides):  # a title, a summary: the same system prompt, then their own text
            side = SYSTEM + [1000 + 300 * turn + 100 * s + i for i in range(120)]
            out, stats = run(engine, side, SamplingParams(max_tokens=4, ignore_eos=True))
            outputs.append(out)
            side_stats.append(stats)
        main = main + outputs[-1 - sides] + [400 + 40 * turn + i for i in range(40)]  # answer + tool output
    return outputs, main_stats, side_stats


def rate(stats) -> float:
    return sum(s.cached_tokens for s in stats) / sum(s.prompt_tokens for s in stats)


def test_side_requests_do_not_evict_the_session(engine):
    with_, main_with, side_with = interleaved(engine, keep=2)
    without, main_without, side_without = interleaved(engine, keep=0)
    later_with, later_without = rate(main_with[1:]), rate(main_without[1:])
    all_with, all_without = rate(main_with + side_with), rate(main_without + side_without)
    print(f"cached-token rate, main turns 2-5: {later_with:.3f} with saved conversations, {later_without:.3f} "
          f"without; all requests: {all_with:.3f} vs {all_without:.3f}")
    assert later_with > 0.85 and later_without < 0.2  # each turn adds 41 new tokens to ~250-450
    assert with_ == without  # the restored KV is what a prefill writes
    for before, s in zip(main_with, main_with[1:]):  # all the session had: its last prompt and answer
        assert s.cached_tokens == before.prompt_tokens + GREEDY.max_tokens - 1
        assert s.restored_tokens == s.cached_tokens - len(SYSTEM)  # the side request kept the system prompt
    assert all(s.restored_tokens == 0 for s in main_without + side_with + side_without)


def test_least_recently_used_is_dropped(engine):
    _, kept, _ = interleaved(engine, keep=2, turns=3, sides=2)
    _, dropped, _ = interleaved(engine, keep=1, turns=3, sides=2)  # the second side request pushes it out
    assert rate(kept[1:]) > 0.85 and rate(dropped[1:]) < 0.2
    assert len(engine.conversations.saved) == 1


def test_a_continuing_turn_is_not_saved(engine):
    engine.reset()
    engine.keep_conversations(4)
    prompt = SYSTEM + list(range(100, 300))
    out, _ = run(engine, prompt)
    # the next turn re-renders the last answer differently (a template dropping its reasoning):
    # a few tokens are lost, not worth a copy of the whole slot
    run(engine, prompt + out[:-3] + [5, 6, 7] + list(range(400, 440)))
    assert engine.conversations.saved == []
    before = list(engine.cached)
    run(engine, SYSTEM + list(range(1000, 1100)))  # a side request overwrites most of it: saved
    [saved] = engine.conversations.saved
    assert saved.tokens == before
    assert saved.k.shape[:2] == (engine.runner.config.num_hidden_layers, len(saved.tokens))
    engine.reset()
    assert engine.conversations.saved == [] and engine.cached == []


def test_over_http_a_side_request_keeps_the_session_cached(tiny_dir):
    app = build_app(str(tiny_dir), RunnerSettings(max_context=1024), name="tiny", warmup=False)
    system = {"role": "system", "content": "You are a careful assistant. " * 10}
    main = [system, {"role": "user", "content": "Plan a trip to the sea, step by step."}]

    def ask(c, messages):
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()
    with LiveServer(app) as server:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120) as c:
            first = ask(c, main)
            ask(c, [system, {"role": "user", "content": "Write a title for this chat: trip"}])
            main += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
            second = ask(c, main)
    usage = second["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
