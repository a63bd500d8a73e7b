"""Several conversations: side requests between an agent's turns do not cost it a prefill.

An interleaved workload (a main session of several turns, a side request after each) runs
on the tiny checkpoint with and without saved conversations; the cached-token rate of
the main session's turns after the first is high with them and low without, and every
output is the same either way (greedy: the restored KV is the KV a prefill would write).
The byte cap is checked on a store over a hand-made slot: the host memory it takes stays
under the cap at every step, the copy being restored included, and is what was allocated.
"""
from __future__ import annotations

import httpx
import pytest
import torch

from ostinato.engine.conversations import Conversations, HostBlocks, block_tokens, common_prefix, kv_bytes
from ostinato.engine.kv_cache import LayerKV
from ostinato.engine.runner import RunnerSettings
from ostinato.engine.sampling import SamplingParams
from ostinato.engine.session import GenerationStats
from ostinato.load import load_engine
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
    host = engine.conversations.host
    assert len(saved.blocks) == host.blocks_for(len(saved.tokens))
    assert host.views[saved.blocks[0]]["k"].shape[:2] == (engine.runner.config.num_hidden_layers, host.block)
    engine.reset()
    assert engine.conversations.saved == [] and engine.cached == []


def hand_made_slot(shapes=(("k", (2, 4)), ("v", (2, 4))), tokens: int = 64, layers: int = 3) -> list[LayerKV]:
    g = torch.Generator().manual_seed(0)
    return [LayerKV({name: torch.randn(tokens, *shape, generator=g) for name, shape in shapes}) for _ in range(layers)]


def test_a_byte_cap_bounds_the_copies():
    layers = hand_made_slot()
    block = block_tokens(64)  # 16 positions
    per_block = kv_bytes(layers, block)
    assert per_block == block * 2 * 3 * 2 * 4 * 4  # K and V, 3 layers, 2 heads of 4, fp32
    store = Conversations(capacity=4, max_bytes=3 * per_block)
    pool = []  # the host memory taken after each step

    def step(what, *args):
        out = getattr(store, what)(*args)
        pool.append(store.pool_bytes // per_block)
        return out
    a, b, c, d, e, f, g = ([k] * n for k, n in ((1, 10), (2, 20), (3, 10), (4, 60), (5, 12), (6, 40), (2, 30)))
    step("save", a, layers)
    step("save", b, layers)  # 1 + 2 blocks: the cap
    b_kv = [(layer.k[:20].clone(), layer.v[:20].clone()) for layer in layers]
    for layer in layers:  # the slot moves on: later copies hold other values
        layer.k.add_(1)
        layer.v.add_(1)
    step("save", c, layers)  # no room left: the least recently used (a) goes
    assert [s.tokens for s in store.saved] == [b, c]
    step("save", d, layers)  # 4 blocks, larger than the cap: not kept, and nothing dropped for it
    assert [s.tokens for s in store.saved] == [b, c]

    assert step("take", b + [7, 8], 3) == 20 and store.taken.tokens == b
    assert store.nbytes == 3 * per_block  # the copy on its way into the slot still counts
    step("save", f, layers)  # 2 restoring + 3 > 3, however much is dropped: not kept
    assert [s.tokens for s in store.saved] == [c]
    step("save", e, layers)  # 2 restoring + 1 + 1 > 3: c goes
    assert [s.tokens for s in store.saved] == [e]
    step("restore", 0, 20, layers)
    assert store.taken is None and store.nbytes == per_block
    for layer, (k, v) in zip(layers, b_kv):
        assert torch.equal(layer.k[:20], k) and torch.equal(layer.v[:20], v)
    step("save", g, layers)  # the session again, longer: into the blocks its last copy freed
    assert [s.tokens for s in store.saved] == [e, g]

    assert pool == [1, 3, 3, 3, 3, 3, 3, 3, 3] and max(pool) * per_block <= store.max_bytes
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for views in store.host.views
                for t in views.values()}
    assert sum(storages.values()) == store.pool_bytes  # the bytes counted are the allocations'
    assert not store.host.gpu  # a CPU slot: plain host memory, synchronous copies
    assert step("take", e, 0) == 12 and step("take", e, 0) == 0


def test_the_count_cap_and_no_byte_cap():
    layers = hand_made_slot(shapes=(("ckv", (6,)),))  # latent attention's one compressed row per token
    store = Conversations(capacity=2)
    for k in range(4):
        store.save([k] * 5, layers)
    assert [s.tokens[0] for s in store.saved] == [2, 3] and store.pool_bytes == 2 * kv_bytes(layers, 16)
    store.save([3] * 8, layers)  # it extends a saved one, which it replaces
    assert [s.tokens for s in store.saved] == [[2] * 5, [3] * 8]
    want = layers[1].ckv[:8].clone()
    layers[1].ckv.zero_()
    assert store.take([3] * 9, beyond=0) == 8
    store.restore(2, 8, layers)  # positions 0 and 1 are the slot's already
    assert torch.equal(layers[1].ckv[2:8], want[2:]) and not layers[1].ckv[:2].any()
    for k in range(5, 8):  # with room under no cap, the pool grows rather than drop what the count keeps
        store.save([k] * 40, layers)
    assert len(store.saved) == 2 and store.pool_bytes == 6 * kv_bytes(layers, 16)
    store.clear()
    assert store.saved == [] and store.nbytes == 0 and len(store.host.free) == 6
    Conversations(capacity=0).save([1] * 5, layers)  # keeps nothing, copies nothing


def test_the_pool_is_reserved_at_load(engine, monkeypatch):
    """Told to keep conversations (at load), the engine takes one slot's worth of blocks, within the
    cap: the copies that fit in it allocate (beside a GPU, page-lock) nothing, so the request that
    switches conversations first pays for its copy only; beyond it the pool grows by what a copy needs."""
    engine.keep_conversations(4)
    assert engine.conversations.pool_bytes == kv_bytes(engine.runner.kv.layers, engine.max_context)
    grown = []
    grow = HostBlocks._grow
    monkeypatch.setattr(HostBlocks, "_grow", lambda self, count: (grown.append(count), grow(self, count)))
    layers = hand_made_slot(tokens=64)  # blocks of 16 positions, 4 for the slot
    store = Conversations(capacity=4)
    store.reserve(layers)
    assert grown == [4] and store.pool_bytes == kv_bytes(layers, 64) and store.nbytes == 0
    for k, n in ((1, 30), (2, 16), (3, 10)):  # 2 + 1 + 1 blocks: the reserve
        store.save([k] * n, layers)
    assert grown == [4] and len(store.saved) == 3 and not store.host.free
    store.save([4] * 20, layers)
    assert grown == [4, 2] and len(store.saved) == 4
    per_block = kv_bytes(layers, 16)
    capped = Conversations(capacity=4, max_bytes=2 * per_block + 1)
    capped.reserve(layers)
    assert capped.pool_bytes == 2 * per_block
    none = Conversations(capacity=0)
    none.reserve(layers)
    assert none.host is None


def test_long_conversations_span_blocks():
    layers = hand_made_slot(tokens=2048)
    assert block_tokens(2048) == 64 and block_tokens(10**6) == 2048 and block_tokens(100) == 16
    store = Conversations(capacity=1)
    store.save(list(range(1000)), layers)
    want = [layer.v[:1000].clone() for layer in layers]
    for layer in layers:
        layer.v.zero_()
    assert store.take(list(range(1000)) + [5], beyond=100) == 1000
    store.restore(100, 1000, layers)  # 100 is inside the second block
    assert all(torch.equal(layer.v[100:1000], w[100:]) and not layer.v[:100].any() for layer, w in zip(layers, want))


@pytest.mark.gpu
def test_copies_of_a_gpu_slot_are_page_locked_in_place():
    layers = [LayerKV({name: t.cuda() for name, t in layer.tensors.items()}) for layer in hand_made_slot()]
    store = Conversations(capacity=2)
    store.save([1] * 20, layers)
    [saved] = store.saved
    assert store.host.gpu and store.host.pinned
    assert all(t.is_pinned() and t.device.type == "cpu" for b in saved.blocks for t in store.host.views[b].values())
    want = [(layer.k[:20].clone(), layer.v[:20].clone()) for layer in layers]
    for layer in layers:
        layer.k.zero_()
        layer.v.zero_()
    assert store.take([1] * 22, beyond=0) == 20
    store.restore(0, 20, layers)
    for layer, (k, v) in zip(layers, want):
        assert torch.equal(layer.k[:20], k) and torch.equal(layer.v[:20], v)


def scraped(metrics: str, name: str) -> float:
    [value] = [float(line.split(" ")[1]) for line in metrics.splitlines() if line.split(" ")[0] == name]
    return value


def test_over_http_a_side_request_keeps_the_session_cached(tiny_dir):
    app = build_app(str(tiny_dir), RunnerSettings(max_context=1024), name="tiny", warmup=False,
                    conversation_bytes=2**20)
    system = {"role": "system", "content": "You are a careful assistant. " * 10}
    main = [system, {"role": "user", "content": "Plan a trip to the sea, step by step."}]

    def ask(c, messages):
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                 "ostinato_return_ids": True})
        assert r.status_code == 200, r.text
        return r.json()
    with LiveServer(app) as server:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120) as c:
            reserved = scraped(c.get("/metrics").text, "ostinato_kv_conversation_pool_bytes")
            first = ask(c, main)
            side = ask(c, [system, {"role": "user", "content": "Write a title for this chat: trip"}])
            main += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
            second = ask(c, main)
            metrics = c.get("/metrics").text
        engine = app.state.worker.loaded.engine
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"]
    # the slot held the side request (its prompt and output, less the last token, never run): what the
    # session shares with it stayed, the rest of its prefix was copied back
    side_slot = side["ostinato_prompt_ids"] + side["choices"][0]["ostinato_output_ids"][:-1]
    restored = cached - common_prefix(side_slot, second["ostinato_prompt_ids"])
    assert restored > 0 and scraped(metrics, "ostinato_restored_tokens_total") == restored
    store = engine.conversations
    [held] = store.saved  # the side request's, copied out when the session came back
    assert held.tokens == side_slot and store.max_bytes == 2**20
    assert scraped(metrics, "ostinato_kv_conversations") == 1
    assert scraped(metrics, "ostinato_kv_conversation_bytes") == store.nbytes \
        == store.host.blocks_for(len(side_slot)) * kv_bytes(engine.runner.kv.layers, store.host.block)
    # the session's copy went back into the slot; its blocks stay in the pool, free for the next copy
    assert scraped(metrics, "ostinato_kv_conversation_pool_bytes") == store.pool_bytes > store.nbytes
    assert reserved == store.pool_bytes  # taken at load, under the cap, and all the copies needed


def test_kv_cache_memory_flag(tiny_dir, capsys):
    from ostinato.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve", "--model", str(tiny_dir)]).kv_cache_memory is None
    assert parse(["serve", "--model", str(tiny_dir), "--kv-cache-memory", "24GiB"]).kv_cache_memory == 24 * 2**30
    with pytest.raises(SystemExit):
        parse(["serve", "--model", str(tiny_dir), "--kv-cache-memory", "plenty"])
    assert "--kv-cache-memory" in capsys.readouterr().err
