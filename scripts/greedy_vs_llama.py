"""Greedy tokens of Ostinato against llama.cpp on the same GGUF file ([K]): the same prompt ids,
N greedy tokens each (end of text ignored), compared position by position; then llama.cpp's
tokens are fed to Ostinato (teacher forcing), so that every position is compared on the same
prefix: whether Ostinato's argmax is llama.cpp's token, and how far Ostinato's log-probabilities
of llama.cpp's top tokens lie from llama.cpp's own.

    python scripts/greedy_vs_llama.py --server /tmp/llama/kit/llama-server --model M.gguf \
        --tokens 32 --json-out /tmp/res/k_greedy.json [--gpu-memory 12GiB ...]

Ostinato runs with the model arguments given (by default every expert on the GPU, as the
placement does when no cap is given); llama.cpp with every layer on the GPU (-ngl 999,
--n-cpu-moe 0), one slot, temperature 0, its top TOP log-probabilities at every position.
Greedy decoding of two correct implementations parts at near-ties, and only there, since each
rounds differently (bf16 activations here, ggml's own kernels and 8-bit activations there);
after a parting the free-running tokens say nothing, which is what teacher forcing is for.
Needs a GPU and the llama.cpp kit.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.llamacpp import LlamaServer, LlamaSettings  # noqa: E402
from ostinato.bench.report import source_state  # noqa: E402
from ostinato.model_args import add_model_args, placement_settings, runner_settings  # noqa: E402

PROMPT = ("You are a customer-service agent. The user writes: my order #W2378156 has not arrived yet, "
          "can you check its status and tell me the delivery date?")


def ostinato_tokens(a):
    """-> (the engine, the prompt ids, its greedy tokens, its startup summary)."""
    from ostinato.engine.sampling import SamplingParams
    from ostinato.load import load_engine, startup_summary

    loaded = load_engine(a.model, runner_settings(a), placement_settings(a), announce=False)
    prompt = loaded.tokenizer.render_ids([{"role": "user", "content": a.prompt}])
    ids = list(loaded.engine.generate(prompt, SamplingParams(max_tokens=a.tokens, temperature=0.0,
                                                             ignore_eos=True)))
    return loaded, prompt, ids, startup_summary(loaded)  # the engine stays: the GPU holds both engines


def forced_logprobs(loaded, prompt: list[int], tokens: list[int]):
    """Ostinato's log-probabilities [len(tokens), vocab] at each of `tokens`' positions, the
    prompt and the tokens before it given (one pass from an empty cache)."""
    import torch

    loaded.engine.reset()
    with torch.inference_mode():
        logits = loaded.runner.forward(prompt + tokens, 0, all_logits=True)
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].float(), dim=-1).cpu()


def top_logprobs(entry: dict) -> list[tuple[int, float]]:
    """(token id, log-probability) of llama.cpp's top candidates at one position, from either
    of its response formats (top_logprobs with logprob, or the older top_probs / probs with prob)."""
    import math

    if "top_logprobs" in entry:
        return [(int(c["id"]), float(c["logprob"])) for c in entry["top_logprobs"]]
    cands = entry.get("top_probs", entry.get("probs", []))
    return [(int(c["id"]), math.log(max(float(c["prob"]), 1e-30))) for c in cands]


def compare_forced(ours, theirs: list[int], probs: list[dict]) -> dict:
    """On llama.cpp's prefix at every position: argmax agreement, and |our log-probability -
    theirs| over llama.cpp's top candidates (median of the per-position maxima, and the max)."""
    import statistics

    agree, gaps, parted = 0, [], []
    for i, tok in enumerate(theirs):
        ours_top = int(ours[i].argmax())
        agree += ours_top == tok
        cands = top_logprobs(probs[i]) if i < len(probs) else []
        if cands:
            gaps.append(max(abs(float(ours[i][t]) - lp) for t, lp in cands))
        if ours_top != tok:
            theirs_gap = cands[0][1] - cands[1][1] if len(cands) > 1 else None
            parted.append({"position": i, "llama.cpp": tok, "ostinato": ours_top,
                           "ostinato_margin": round(float(ours[i][ours_top] - ours[i][tok]), 4),
                           "llama_margin": None if theirs_gap is None else round(theirs_gap, 4)})
    return {"agree": agree, "positions": len(theirs), "parted": parted,
            "logprob_diff_median": round(statistics.median(gaps), 4) if gaps else None,
            "logprob_diff_max": round(max(gaps), 4) if gaps else None}


def llama_tokens(a, prompt: list[int]) -> tuple[list[int], list]:
    import httpx

    log = Path(a.log or "llama_greedy.log")
    with LlamaServer(a.server, LlamaSettings(0), a.model, context=len(prompt) + a.tokens + 64, port=a.port,
                     gpu=a.gpu, log=log) as srv:
        if not srv.ready:
            raise SystemExit(f"llama-server did not start (log: {log})")
        body = {"prompt": prompt, "n_predict": a.tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "n_probs": a.top, "post_sampling_probs": False}
        r = httpx.post(f"{srv.url}/completion", json=body, timeout=300)
        r.raise_for_status()
        out = r.json()
    return list(out["tokens"]), out.get("completion_probabilities", [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--server", required=True, help="llama-server")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default=PROMPT, help="a user message, rendered with the file's chat template")
    ap.add_argument("--top", type=int, default=5, help="llama.cpp's candidates compared at each position")
    ap.add_argument("--gpu", default="0")
    ap.add_argument("--port", type=int, default=8092)
    ap.add_argument("--log", help="llama-server's output (default: llama_greedy.log here)")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    loaded, prompt, ours, summary = ostinato_tokens(a)
    theirs, probs = llama_tokens(a, prompt)
    forced = compare_forced(forced_logprobs(loaded, prompt, theirs), theirs, probs)
    agree = sum(x == y for x, y in zip(ours, theirs))
    first = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
    result = {"kind": "ostinato.greedy_vs_llama", **source_state(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": a.model,
              "prompt_tokens": len(prompt), "tokens": a.tokens, "ostinato": ours, "llama.cpp": theirs,
              "agree": agree, "common_prefix": a.tokens if first is None else first,
              "teacher_forced": forced,
              "placement": {k: summary.get(k) for k in ("format", "resident_experts", "experts", "dtype")},
              "seconds": round(time.perf_counter() - t0, 1)}
    print(f"greedy: {agree} of {a.tokens} tokens agree; common prefix {result['common_prefix']}")
    print(f"on llama.cpp's tokens: Ostinato's argmax agrees at {forced['agree']} of {forced['positions']}; "
          f"|log-prob difference| over llama.cpp's top {a.top}: median {forced['logprob_diff_median']}, "
          f"max {forced['logprob_diff_max']}")
    for p in forced["parted"]:
        print(f"  parted at {p['position']}: llama.cpp {p['llama.cpp']} (its margin over the next "
              f"{p['llama_margin']}), Ostinato {p['ostinato']} (by {p['ostinato_margin']})")
    print(json.dumps(result))
    if a.json_out:
        a.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
