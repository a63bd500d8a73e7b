"""Token selection: each logit processor on crafted logits, seeded draws, and the HTTP fields.

The unit tests read the sampler's stages (`process`: bias and penalties; `distribution`:
temperature, top-k, top-p, min-p) on logits made so the right answer is known. The HTTP
tests run the tiny checkpoint: a random model, so they check effects that do not depend
on what it says (a +100 bias forces a token, top_k 1 is greedy, a field left out takes
generation_config.json's default).
"""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from ostinato.engine.runner import RunnerSettings
from ostinato.engine.sampling import Sampler, SamplingDefaults, SamplingParams
from ostinato.load import load_engine
from ostinato.server.app import build_app
from tests.test_server import CTX, KEY, LiveServer

V = 10
LOGITS = torch.tensor([3.0, -2.0, 1.0, 0.5, 2.5, -1.0, 0.0, 1.5, -0.5, 2.0])  # order: 0 4 9 7 2 3 6 8 5 1


def sampler(prompt=(), **kw) -> Sampler:
    return Sampler(SamplingParams(**kw), "cpu", V, list(prompt))


@pytest.mark.parametrize("k", [1, 3, 7, V, V + 5])
def test_top_k_keeps_exactly_k_candidates(k):
    probs = sampler(temperature=1.0, top_k=k).distribution(LOGITS)
    kept = set(torch.nonzero(probs).flatten().tolist())
    assert kept == set(torch.topk(LOGITS, min(k, V)).indices.tolist())
    ties = sampler(temperature=1.0, top_k=2).distribution(torch.zeros(V))
    assert int((ties > 0).sum()) == 2  # exactly k, also among equal logits


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_is_relative_to_the_most_likely_token(min_p):
    probs = sampler(temperature=1.0, min_p=min_p).distribution(LOGITS)
    full = torch.softmax(LOGITS, -1)
    assert torch.equal(probs > 0, full >= min_p * full.max())
    assert torch.allclose(probs[probs > 0], full[probs > 0])


def test_top_p_keeps_the_smallest_nucleus():
    full = torch.softmax(LOGITS, -1)
    top = torch.sort(full, descending=True)
    probs = sampler(temperature=1.0, top_p=float(top.values[:3].sum()) - 1e-4).distribution(LOGITS)
    assert set(torch.nonzero(probs).flatten().tolist()) == set(top.indices[:3].tolist())
    assert set(torch.nonzero(sampler(temperature=1.0, top_p=1e-6).distribution(LOGITS)).flatten().tolist()) == {0}


def test_temperature_scales_the_logits():
    probs = sampler(temperature=0.5).distribution(LOGITS)
    assert torch.allclose(probs, torch.softmax(LOGITS / 0.5, -1))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    s = sampler(prompt=[0, 1], repetition_penalty=2.0)
    out = s.process(LOGITS)
    assert out[0] == 1.5 and out[1] == -4.0  # seen in the prompt: 3 / 2, -2 * 2
    untouched = [i for i in range(V) if i not in (0, 1)]
    assert torch.equal(out[untouched], LOGITS[untouched])
    assert s(LOGITS) == 4  # greedy over the penalised logits: 2.5 beats 1.5
    out = s.process(LOGITS)  # the drawn token is seen too
    assert out[4] == 1.25 and out[0] == 1.5  # once seen, penalised once (not per occurrence)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    s = sampler(prompt=[9], presence_penalty=0.5, frequency_penalty=0.25)
    assert torch.equal(s.process(LOGITS), LOGITS)  # the prompt does not count
    for _ in range(3):
        s(torch.nn.functional.one_hot(torch.tensor(7), V).float() * 50)  # draws token 7
    s(torch.nn.functional.one_hot(torch.tensor(2), V).float() * 50)  # and token 2 once
    expected = LOGITS.clone()
    expected[7] -= 0.5 + 3 * 0.25
    expected[2] -= 0.5 + 1 * 0.25
    assert torch.allclose(s.process(LOGITS), expected)
    negative = sampler(presence_penalty=-2.0)  # a negative penalty encourages repetition
    negative(LOGITS)
    assert negative.process(LOGITS)[0] == LOGITS[0] + 2.0


def test_logit_bias_bans_and_forces_under_greedy():
    assert sampler()(LOGITS) == 0
    assert sampler(logit_bias={0: -100.0})(LOGITS) == 4
    assert sampler(logit_bias={1: 100.0})(LOGITS) == 1
    out = sampler(logit_bias={3: 0.75, 5: -1.0}).process(LOGITS)
    assert out[3] == 1.25 and out[5] == -2.0 and out[0] == 3.0
    drawn = {sampler(temperature=1.0, seed=s, logit_bias={8: 100.0})(LOGITS) for s in range(20)}
    assert drawn == {8}


def test_greedy_is_the_argmax_of_the_processed_logits():
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(V) * 3
        assert sampler()(logits) == int(torch.argmax(logits))
        s = sampler(prompt=[int(torch.argmax(logits))], repetition_penalty=1.3, frequency_penalty=0.4,
                    logit_bias={2: 0.7}, top_k=2, min_p=0.5, top_p=0.1)  # top-k/p, min-p: no effect at t=0
        expected = int(torch.argmax(s.process(logits)))  # before the draw updates the penalties
        assert s(logits) == expected


def test_seeded_sampling_repeats_and_follows_the_distribution():
    def draws(seed, n=40, **kw):
        s = sampler(temperature=1.0, seed=seed, **kw)
        return [s(LOGITS) for _ in range(n)]
    assert draws(1) == draws(1) != draws(2)
    assert draws(3, presence_penalty=1.0) == draws(3, presence_penalty=1.0)
    assert set(draws(4, n=400, top_k=3)) == {0, 4, 9}
    counts = torch.bincount(torch.tensor(draws(5, n=4000)), minlength=V).float() / 4000
    assert torch.allclose(counts, torch.softmax(LOGITS, -1), atol=0.03)


@pytest.mark.parametrize("bad", [dict(top_k=-2), dict(min_p=1.5), dict(repetition_penalty=0.0),
                                 dict(logit_bias={1: 101.0}), dict(top_p=0.0), dict(temperature=-1.0)])
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_defaults_from_generation_config(tmp_path, tiny_dir):
    class Dir:
        tokenizer_dir = tmp_path
    assert SamplingDefaults.of(Dir()) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 5, "min_p": 0.1}))
    assert SamplingDefaults.of(Dir()) == SamplingDefaults(temperature=0.0, top_k=5, min_p=0.1)

    class Gguf:
        metadata = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.penalty_repeat": 1.1}
    assert SamplingDefaults.of(Gguf()) == SamplingDefaults(temperature=0.6, top_k=20, repetition_penalty=1.1)

    class Tiny:
        tokenizer_dir = tiny_dir
    d = SamplingDefaults.of(Tiny())  # what the synthetic checkpoint writes (Qwen3's values)
    assert (d.temperature, d.top_p, d.top_k) == (0.7, 0.8, 20) and d.get("min_p", 0.0) == 0.0


@pytest.mark.gpu
def test_a_step_reads_nothing_back_but_the_token():
    logits = torch.randn(1000, device="cuda")
    s = Sampler(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                               presence_penalty=0.3, frequency_penalty=0.2, logit_bias={3: 5.0}, seed=0),
                "cuda", 1000, [1, 2, 3])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            token = s.select(s.process(logits))
            s.seen.index_fill_(0, token, True)
            s.counts.index_add_(0, token, s._one)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- over HTTP ---

NAME = "tiny-sampling"


@pytest.fixture(scope="module")
def http(tiny_dir):
    app = build_app(str(tiny_dir), RunnerSettings(max_context=CTX), api_key=KEY, name=NAME, warmup=False)
    with LiveServer(app) as server:
        server.wait_ready()
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
            yield client


def ids(http, path="/v1/chat/completions", **body) -> list[int]:
    base = {"messages": [{"role": "user", "content": "Tell me about the sea"}]} if "chat" in path else \
        {"prompt": "The sea is"}
    r = http.post(path, json={"model": NAME, "max_tokens": 6, "ignore_eos": True, "ostinato_return_ids": True,
                              **base, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["ostinato_output_ids"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_logit_bias_top_k_and_min_p_over_http(http, path):
    greedy = ids(http, path, temperature=0)
    assert ids(http, path, temperature=0, logit_bias={"42": 100}) == [42] * 6
    assert ids(http, path, temperature=0, logit_bias={str(greedy[0]): -100})[0] != greedy[0]
    assert ids(http, path, temperature=1.0, top_k=1, seed=3) == greedy  # top_k 1 is greedy
    assert ids(http, path, temperature=1.0, min_p=1.0, seed=3) == greedy  # so is min_p 1
    # the tiny model's logits stay within about +-12: +20 makes 42 the first choice, -2 per use ends that
    out = ids(http, path, temperature=0, max_tokens=12, logit_bias={"42": 20}, frequency_penalty=2.0)
    assert out[0] == 42 and 1 < out.count(42) < 12
    assert ids(http, path, temperature=0, max_tokens=12, logit_bias={"42": 20}) == [42] * 12


# The tiny model never repeats itself when greedy: a bias on token 42 (also in the prompt)
# gives the penalties something to push against.
PENALTIES = [dict(repetition_penalty=1.5, logit_bias={42: 10.0}), dict(repetition_penalty=0.7),
             dict(presence_penalty=2.0, logit_bias={42: 10.0}), dict(frequency_penalty=1.0, logit_bias={42: 10.0}),
             dict(presence_penalty=-2.0, logit_bias={42: 8.0}),
             dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, logit_bias={42: 10.0, 7: 2.0})]
PROMPT = list(range(100, 120)) + [42, 101, 102]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return load_engine(str(tiny_dir), RunnerSettings(device="cpu", max_context=CTX)).engine


@pytest.mark.parametrize("penalty", PENALTIES, ids=[str(i) for i in range(len(PENALTIES))])
def test_penalised_greedy_matches_an_oracle(engine, penalty):
    """Each step's token is the argmax of that step's logits (recomputed from scratch) after
    the penalties, counted in Python over the prompt and the output so far."""
    prompt = PROMPT
    out = list(engine.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, **penalty)))
    r, pres, freq = (penalty.get("repetition_penalty", 1.0), penalty.get("presence_penalty", 0.0),
                     penalty.get("frequency_penalty", 0.0))
    for i, token in enumerate(out):
        engine.reset()
        logits = engine.runner.forward(prompt + out[:i], 0).clone()
        for t, b in penalty.get("logit_bias", {}).items():
            logits[t] += b
        for t in set(prompt + out[:i]):
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        for t in set(out[:i]):
            logits[t] -= pres + freq * out[:i].count(t)
        assert token == int(torch.argmax(logits)), (i, out)
    engine.reset()
    bias_only = SamplingParams(max_tokens=10, ignore_eos=True, logit_bias=penalty.get("logit_bias", {}))
    assert out != list(engine.generate(prompt, bias_only))  # the penalties changed the output


@pytest.mark.parametrize("penalty", PENALTIES[:4], ids=[str(i) for i in range(4)])
def test_penalties_over_http_are_the_engines(http, engine, penalty):
    body = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in penalty.items()}
    r = http.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                           "ignore_eos": True, "ostinato_return_ids": True, **body}).json()
    prompt, out = r["ostinato_prompt_ids"], r["choices"][0]["ostinato_output_ids"]
    engine.reset()
    assert out == list(engine.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, **penalty)))


def test_defaults_come_from_generation_config(http):
    left_out = ids(http, seed=7, max_tokens=12)
    assert left_out == ids(http, seed=7, max_tokens=12, temperature=0.7, top_p=0.8, top_k=20)
    assert left_out != ids(http, seed=7, max_tokens=12, temperature=1.0, top_p=1.0, top_k=0)


def test_top_k_on_messages(http):
    def message(**kw):
        r = http.post("/v1/messages", json={"model": NAME, "max_tokens": 6, "ignore_eos": True,
                                            "messages": [{"role": "user", "content": "Tell me about the sea"}], **kw})
        assert r.status_code == 200, r.text
        return r.json()["content"][0]["text"]
    assert message(temperature=1.0, top_k=1, seed=3) == message(temperature=0)
    assert http.post("/v1/messages", json={"model": NAME, "max_tokens": 2, "top_k": -1, "messages": [
        {"role": "user", "content": "x"}]}).status_code == 400


OUT_OF_RANGE = [({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
                ({"min_p": -0.1}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
                ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"five": 1}}, "logit_bias"),
                ({"logit_bias": {"99999999": 1}}, "outside the vocabulary"), ({"logit_bias": [1]}, "logit_bias")]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("body,words", OUT_OF_RANGE, ids=[str(i) for i in range(len(OUT_OF_RANGE))])
def test_out_of_range_sampling_gets_a_400(http, path, body, words):
    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    r = http.post(path, json={"model": NAME, "max_tokens": 1, **base, **body})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()
