"""Whole-model check of a placement against all experts on the GPU (GPU machine).

Each phase runs in its own process (memory caps and pinned host memory do not mix
between placements). Phase `all` (every expert in the pool) writes the reference:
logits of a split-path prompt, an upload-path prompt and N greedy decode steps. Other
phases load a residency under a memory cap, feed the same tokens and compare logits
(relative error of the max |difference|) and time decode steps. One JSON line per phase.

    python scripts/check_hybrid.py --model synth:qwen3-30b-a3b --residency R --name hybrid \
        --gpu-memory 32GiB --ref /tmp/ref.pt
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ostinato.config import parse_bytes
from ostinato.engine.placement import PlacementSettings
from ostinato.engine.runner import RunnerSettings
from ostinato.load import load_engine


def prompt_ids(tok, n: int) -> list[int]:
    from ostinato.sessions.read import load_sessions
    from ostinato.planner.profile import session_stream

    sessions = load_sessions("embedded:4")
    ids = []
    for s in sessions:
        ids += session_stream(s, tok).ids
    return ids[:n]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_forward(runner, ids, pos, all_logits=False):
    sync()
    t0 = time.perf_counter()
    out = runner.forward(ids, pos, all_logits=all_logits)
    sync()
    return out, time.perf_counter() - t0


def decode_steps(runner, tokens: list[int], pos: int) -> tuple[list[float], torch.Tensor]:
    """Decode the given tokens from `pos` on, each step timed: (seconds per step, logits)."""
    steps, logits = [], []
    for i, t in enumerate(tokens):
        out, dt = timed_forward(runner, [t], pos + i)
        steps.append(dt)
        logits.append(out.float().cpu())
    return steps, torch.stack(logits)


def ms(steps: list[float]) -> dict:
    s = sorted(1000 * x for x in steps[2:])
    return {"median": round(statistics.median(s), 3), "p90": round(s[int(0.9 * (len(s) - 1))], 3)}


def ablation(runner, tokens: list[int], pos: int, first: torch.Tensor) -> dict:
    """The decode step without its parts, on the same tokens at the same positions (the KV
    written there is rewritten identically): graph without borrowed memory (captured again
    with borrowing off), the per-layer branches (host-driven, no graph), then the graph with
    fresh borrowing again (against order effects)."""
    from ostinato.layers.moe.graph_hybrid import GraphHybridExperts

    graphed = runner.experts
    if not isinstance(graphed, GraphHybridExperts):
        return {"skipped": f"the decode backend is {type(graphed).__name__}, not the graph hybrid"}
    hybrid = graphed.hybrid
    hybrid.before_prefill()  # borrowed experts go back: the tables are the plan's again
    hybrid.borrow = None
    graphed.stop()  # its worker; the hybrid serves on
    runner.set_experts(hybrid)  # captures again, without the borrowing ops
    out = {}
    steps, logits = decode_steps(runner, tokens, pos)
    out["graph"] = {**ms(steps), "max_abs_diff_vs_graph_borrow": float((logits - first).abs().max())}
    with runner.experts_swapped(hybrid):  # no graph: every layer's branches joined from Python
        steps, eager = decode_steps(runner, tokens, pos)
    out["per_layer"] = {**ms(steps), "max_abs_diff_vs_graph": float((eager - logits).abs().max())}
    # borrowing once more, fresh, last: the first measurement also paid for whatever warms up
    from ostinato.layers.moe.borrow import Borrowing

    runner.experts.stop()
    hybrid.borrow = Borrowing(hybrid)
    runner.set_experts(hybrid)
    steps, _ = decode_steps(runner, tokens, pos)
    out["graph_borrow_again"] = ms(steps)
    runner.experts.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--residency", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--ref", required=True, help="reference file: written by --name all, read by others")
    ap.add_argument("--gpu-memory")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--split-tokens", type=int, default=256)
    ap.add_argument("--upload-tokens", type=int, default=1024)
    ap.add_argument("--upload-threshold", type=int, default=512)
    ap.add_argument("--no-graph", action="store_true", help="decode host-driven, layer by layer")
    ap.add_argument("--no-borrow", action="store_true", help="do not lend the flex slots during decode")
    ap.add_argument("--cpu-threads", type=int, help="CPU expert threads (default: the physical cores)")
    ap.add_argument("--calibration", help="a residency file holding a calibration: the split-path prompt runs "
                    "again as a split pass with uploads (layers/moe/hybrid.py, MixedPass), checked and timed")
    ap.add_argument("--ablation", action="store_true", help="then decode the same tokens again, in the same "
                    "process: graph without borrowed memory, and per-layer branches (no graph, no borrowing)")
    a = ap.parse_args()
    cap = parse_bytes(a.gpu_memory) if a.gpu_memory else None
    t0 = time.perf_counter()
    loaded = load_engine(a.model, RunnerSettings(max_context=4096, prefill_chunk=2048, cuda_graph=not a.no_graph,
                                                    cpu_threads=a.cpu_threads),
                         PlacementSettings(residency=a.residency, gpu_memory=cap, upload_threshold=a.upload_threshold,
                                           borrow=not a.no_borrow))
    load_s = time.perf_counter() - t0
    runner, tok = loaded.runner, loaded.tokenizer
    ids = prompt_ids(tok, a.upload_tokens)
    res = {"name": a.name, "load_s": round(load_s, 1), "graph": runner.graphs is not None,
           "borrow": not a.no_borrow, "devices": sorted(set(runner.layer_devices or [str(runner.device)]))}
    with torch.inference_mode():
        # split path: a pass of split_tokens (< Np); upload path: upload_tokens (>= Np)
        split_logits, res["split_prefill_s"] = timed_forward(runner, ids[:a.split_tokens], 0, all_logits=True)
        mixed_logits = None
        if a.calibration:
            _, res["split_prefill_warm_s"] = timed_forward(runner, ids[:a.split_tokens], 0, all_logits=True)
            from ostinato.engine.residency import Residency
            from ostinato.layers.moe.hybrid import MixedPass

            mixed = MixedPass.from_calibration(Residency.load(a.calibration).calibration, measured=False)
            hybrids = [b.unwrapped for b in getattr(runner.experts, "backends", {"": runner.experts}).values()]
            for h in hybrids:
                h.mixed = mixed
            timed_forward(runner, ids[:a.split_tokens], 0, all_logits=True)  # warm-up
            mixed_logits, res["mixed_prefill_s"] = timed_forward(runner, ids[:a.split_tokens], 0, all_logits=True)
            for h in hybrids:
                h.mixed = None
        up_logits, res["upload_prefill_s"] = timed_forward(runner, ids, 0, all_logits=True)
        logits = up_logits[-1]
        if a.name == "all":
            forced = []
        else:
            ref = torch.load(a.ref)
            forced = ref["tokens"]
        steps, dec_logits, tokens = [], [], []
        pos = len(ids)
        for i in range(a.steps):
            t = int(logits.argmax()) if not forced else forced[i]
            tokens.append(t)
            logits, dt = timed_forward(runner, [t], pos)
            pos += 1
            steps.append(dt)
            dec_logits.append(logits.float().cpu())
    dec = torch.stack(dec_logits)
    res["tpot_ms_median"] = round(1000 * statistics.median(steps[2:]), 3)
    res["tpot_ms_p90"] = round(1000 * sorted(steps[2:])[int(0.9 * (len(steps) - 2))], 3)
    if torch.cuda.is_available():  # per GPU (a cap applies to each)
        peaks = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(torch.cuda.device_count())]
        res["max_memory_allocated_gib"] = round(max(peaks), 2)
        if len(peaks) > 1:
            res["max_memory_allocated_gib_per_gpu"] = [round(p, 2) for p in peaks]
    res["placement_stats"] = runner.placement_stats()
    if a.name == "all":
        torch.save({"tokens": tokens, "split": split_logits[-64:].float().cpu(), "upload": up_logits[-64:].float().cpu(),
                    "decode": dec}, a.ref)
    else:
        def rel(x, y):
            return round(float((x - y).abs().max() / y.abs().max()), 5)

        res["rel_err_split"] = rel(split_logits[-64:].float().cpu(), ref["split"])
        if mixed_logits is not None:
            res["rel_err_mixed"] = rel(mixed_logits[-64:].float().cpu(), ref["split"])
        res["rel_err_upload"] = rel(up_logits[-64:].float().cpu(), ref["upload"])
        res["rel_err_decode"] = rel(dec, ref["decode"])
        res["greedy_agree"] = float((dec.argmax(-1) == ref["decode"].argmax(-1)).float().mean())
    if cap:
        res["gpu_memory_cap_gib"] = round(cap / 2**30, 2)
    print(json.dumps(res), flush=True)
    if a.ablation:  # a second line: the check above stands even if this part fails
        with torch.inference_mode():
            print(json.dumps({"name": f"{a.name}-ablation", "graph_borrow": ms(steps),
                              **ablation(runner, tokens, len(ids), dec)}))


if __name__ == "__main__":
    main()
