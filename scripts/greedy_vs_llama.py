"""Greedy tokens of Ostinato against llama.cpp on the same GGUF file ([K]): the same prompt ids,
N greedy tokens each (end of text ignored), compared position by position.

    python scripts/greedy_vs_llama.py --server /tmp/llama/kit/llama-server --model M.gguf \
        --tokens 32 --json-out /tmp/res/k_greedy.json [--gpu-memory 12GiB ...]

Ostinato runs with the model arguments given (by default every expert on the GPU, as the
placement does when no cap is given); llama.cpp with every layer on the GPU (-ngl 999,
--n-cpu-moe 0), one slot, temperature 0. At the first position where the two differ, the
top two probabilities llama.cpp gives there are printed: greedy decoding of two correct
implementations parts at near-ties, and only there, since each rounds differently (bf16
activations here, ggml's own kernels there). Needs a GPU and the llama.cpp kit.
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


def ostinato_tokens(a) -> tuple[list[int], list[int], dict]:
    from ostinato.engine.factory import load_engine, startup_summary
    from ostinato.engine.sampling import SamplingParams

    loaded = load_engine(a.model, runner_settings(a), placement_settings(a), announce=False)
    prompt = loaded.tokenizer.render_ids([{"role": "user", "content": a.prompt}])
    ids = list(loaded.engine.generate(prompt, SamplingParams(max_tokens=a.tokens, temperature=0.0,
                                                             ignore_eos=True)))
    return prompt, ids, startup_summary(loaded)  # the engine stays: the GPU holds both engines


def llama_tokens(a, prompt: list[int]) -> tuple[list[int], list]:
    import httpx

    log = Path(a.log or "llama_greedy.log")
    with LlamaServer(a.server, LlamaSettings(0), a.model, context=len(prompt) + a.tokens + 64, port=a.port,
                     gpu=a.gpu, log=log) as srv:
        if not srv.ready:
            raise SystemExit(f"llama-server did not start (log: {log})")
        body = {"prompt": prompt, "n_predict": a.tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "n_probs": 2}
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
    ap.add_argument("--gpu", default="0")
    ap.add_argument("--port", type=int, default=8092)
    ap.add_argument("--log", help="llama-server's output (default: llama_greedy.log here)")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    prompt, ours, summary = ostinato_tokens(a)
    theirs, probs = llama_tokens(a, prompt)
    agree = sum(x == y for x, y in zip(ours, theirs))
    first = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
    result = {"kind": "ostinato.greedy_vs_llama", **source_state(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": a.model,
              "prompt_tokens": len(prompt), "tokens": a.tokens, "ostinato": ours, "llama.cpp": theirs,
              "agree": agree, "common_prefix": a.tokens if first is None else first,
              "placement": {k: summary.get(k) for k in ("format", "resident_experts", "experts", "dtype")}, "seconds": round(time.perf_counter() - t0, 1)}
    if first is not None and first < len(probs):
        result["llama_top2_at_first_difference"] = probs[first].get("top_probs", probs[first].get("probs"))
    print(f"greedy: {agree} of {a.tokens} tokens agree; common prefix {result['common_prefix']}")
    if first is not None:
        print(f"  first difference at {first}: ostinato {ours[first]}, llama.cpp {theirs[first]}; "
              f"llama.cpp's top two there: {result.get('llama_top2_at_first_difference')}")
    print(json.dumps(result))
    if a.json_out:
        a.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
