"""Run sessions through the engine and count routes (the `profile` step of planning)."""
from __future__ import annotations

import torch
from tqdm import tqdm

from ostinato.engine.routes import RouteCounts
from ostinato.planner.profile import CountingExperts, session_stream, turn_prompts


def profile_sessions(loaded, sessions, progress: bool = True, desc: str = "profile", wrap=None,
                     on_pass=None, on_session=None) -> RouteCounts:
    """Route counts of every session's tokens, prefilled chunk by chunk. wrap(backend) -> a backend
    that sees each pass's routing too, and on_pass(ids, start) runs after each pass (start 0: a new
    session): how planner/skew.trace_sessions reads per-token routing from the same passes.
    on_session(done, of) after each session (serve's /health shows it)."""
    runner, tok, cfg = loaded.runner, loaded.tokenizer, loaded.runner.config
    counts = RouteCounts.zeros(cfg.moe_layers, cfg.num_experts, device=runner.device)
    counts.prompts = []
    counter = CountingExperts(wrap(runner.experts) if wrap else runner.experts, counts)
    chunk = runner.settings.prefill_chunk
    with runner.experts_swapped(counter):
        bar = tqdm(sessions, desc=desc, disable=not progress, unit="session")
        for s in bar:
            st = session_stream(s, tok, max_tokens=runner.max_context)
            counts.max_tokens = max(counts.max_tokens, len(st.ids))
            counts.prompts += turn_prompts(st)
            for i in range(0, len(st.ids), chunk):
                part = st.is_output[i:i + chunk]
                counter.is_output = torch.tensor(part, dtype=torch.bool, device=runner.device)
                runner.forward(st.ids[i:i + chunk], i)
                if on_pass is not None:
                    on_pass(st.ids[i:i + chunk], i)
            n_out = sum(st.is_output)
            counts.tokens["decode"] += n_out
            counts.tokens["prefill"] += len(st.ids) - n_out
            counts.sessions += 1
            if on_session is not None:
                on_session(counts.sessions, len(sessions))
            bar.set_postfix(tokens=sum(counts.tokens.values()), longest=counts.max_tokens)
    counts.prefill = {l: c.cpu() for l, c in counts.prefill.items()}
    counts.decode = {l: c.cpu() for l, c in counts.decode.items()}
    return counts
