"""scripts/greedy_vs_llama.py's comparison ([K]): the teacher-forced pass against the engine's own
greedy decode, and the reading of llama.cpp's two log-probability formats."""
from __future__ import annotations

import math

import torch

from scripts.greedy_vs_llama import compare_forced, forced_logprobs, top_logprobs


def test_both_response_formats_of_llama_cpp():
    new = {"top_logprobs": [{"id": 5, "token": "a", "logprob": -0.1}, {"id": 7, "token": "b", "logprob": -2.5}]}
    old = {"top_probs": [{"id": 5, "tok_str": "a", "prob": 0.5}, {"id": 7, "tok_str": "b", "prob": 0.25}]}
    assert top_logprobs(new) == [(5, -0.1), (7, -2.5)]
    assert top_logprobs(old) == [(5, math.log(0.5)), (7, math.log(0.25))]
    assert top_logprobs({}) == []


def test_compare_forced_names_each_parting_with_both_margins():
    ours = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 2.1]]), dim=-1)
    theirs = [0, 1]
    probs = [{"top_logprobs": [{"id": 0, "logprob": float(ours[0, 0])}, {"id": 1, "logprob": float(ours[0, 1])}]},
             {"top_logprobs": [{"id": 1, "logprob": -0.60}, {"id": 2, "logprob": -0.70}]}]
    out = compare_forced(ours, theirs, probs)
    assert out["agree"] == 1 and out["positions"] == 2
    (p,) = out["parted"]
    assert p["position"] == 1 and p["ostinato"] == 2 and p["llama.cpp"] == 1
    assert math.isclose(p["ostinato_margin"], 0.1, abs_tol=1e-4) and math.isclose(p["llama_margin"], 0.1, abs_tol=1e-4)
    assert out["logprob_diff_max"] > 0 and out["logprob_diff_median"] >= 0


def test_teacher_forcing_its_own_greedy_tokens_agrees_everywhere(tiny_dir):
    """The forced pass reproduces the engine's greedy decode: the script measures llama.cpp, not
    a difference between our prefill and our decode."""
    from ostinato.engine.runner import RunnerSettings
    from ostinato.engine.sampling import SamplingParams
    from ostinato.load import load_engine

    loaded = load_engine(str(tiny_dir), RunnerSettings(device="cpu", max_context=256), announce=False)
    prompt = loaded.tokenizer.render_ids([{"role": "user", "content": "where is my order?"}])
    greedy = list(loaded.engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    lp = forced_logprobs(loaded, prompt, greedy)
    assert lp.shape[0] == len(greedy) == 12
    probs = [{"top_logprobs": [{"id": t, "logprob": float(lp[i, t])}]} for i, t in enumerate(greedy)]
    out = compare_forced(lp, greedy, probs)
    assert out["agree"] == 12 and out["parted"] == [] and out["logprob_diff_max"] == 0.0
