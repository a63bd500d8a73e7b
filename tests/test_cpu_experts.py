"""Oracle tests of the CPU branch (cold experts): the native kernels and the torch fallback
against torch_reference (fp32 math on the same weights).

Legend: T tokens, K experts per token, E experts, D hidden, F expert FFN size; a hot
fraction h removes that share of the routes (they would run on the GPU).
Native tests skip, with the reason, where the extension cannot be built or the CPU lacks
AVX-512; the first build is cached (~10 s on 2 cores).
"""
from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from ostinato.kernels.cpu import build
from ostinato.layers.moe import cpu_experts as ce_mod
from ostinato.threads import process_layout
from ostinato.layers.moe.cpu_experts import CpuExperts, torch_reference
from ostinato.layers.moe.types import ExpertWeights

E, K, D, F = 16, 8, 256, 128
TOKENS = [1, 7, 64, 512]
HOT = [0.0, 0.5, 1.0]
# Native results are fp32 sums of exact products; bf16 rounding of h alone would be ~1e-3.
TOL = 1e-4


def native_skip_reason() -> str | None:
    ext = build.load_cpu_extension()
    if ext is None:
        return f"native CPU extension unavailable: {build.load_error()}"
    if not ext.cpu_features()["avx512"]:
        return "this CPU lacks AVX-512; the torch fallback is used"
    return None


def features() -> dict:
    ext = build.load_cpu_extension()
    return ext.cpu_features() if ext is not None else {}


@pytest.fixture(scope="module")
def native():
    reason = native_skip_reason()
    if reason:
        pytest.skip(reason)
    return build.load_cpu_extension()


def make_layer(dtype, d=D, f=F, e=E, seed=0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * f, d, generator=g) / d**0.5).to(dtype)
    w2 = (torch.randn(e, d, f, generator=g) / f**0.5).to(dtype)
    return ExpertWeights(w13, w2)


def make_routes(T, hot, e=E, k=K, seed=1):
    """Top-k routing of T tokens, then a random `hot` share of the routes removed."""
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.topk(torch.randn(T, e, generator=g).softmax(-1), k)
    w = w / w.sum(-1, keepdim=True)
    tok = torch.arange(T)[:, None].expand(T, k).reshape(-1)
    n_cold = round((1 - hot) * T * k)
    keep = torch.randperm(T * k, generator=g)[:n_cold].sort().values
    return tok[keep].int(), ids.reshape(-1)[keep].int(), w.reshape(-1)[keep].float()


def make_x(T, dtype, d=D, seed=2):
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rel_err(got, ref) -> float:
    denom = ref.norm().item()
    return (got - ref).norm().item() / denom if denom else got.norm().item()


@pytest.fixture(scope="module")
def layers():
    return {dt: make_layer(dt) for dt in (torch.bfloat16, torch.float32)}


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hot", HOT)
@pytest.mark.parametrize("T", TOKENS)
def test_matches_oracle(backend, dtype, hot, T, layers):
    if backend == "native" and native_skip_reason():
        pytest.skip(native_skip_reason())
    w = layers[dtype]
    experts = CpuExperts([w], num_threads=2, backend=backend, spin_us=100)
    x = make_x(T, dtype)
    tok, ids, wts = make_routes(T, hot)
    out = torch.full((T, D), float("nan"))
    experts.submit(0, x, tok, ids, wts, out)
    assert experts.wait() is out
    ref = torch_reference(w.w13, w.w2, x, tok, ids, wts)
    if hot == 1.0:
        assert torch.equal(out, torch.zeros(T, D))
    else:
        assert rel_err(out, ref) < TOL
    experts.close()


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_no_cold_routes_gives_zeros_without_reading_weights(backend):
    if backend == "native" and native_skip_reason():
        pytest.skip(native_skip_reason())
    poisoned = ExpertWeights(torch.full((E, 2 * F, D), float("nan")).bfloat16(),
                             torch.full((E, D, F), float("nan")).bfloat16())
    experts = CpuExperts({5: poisoned}, num_threads=1, backend=backend, spin_us=100)
    out = torch.full((9, D), 3.0)
    empty_i = torch.empty(0, dtype=torch.int32)
    experts.forward(5, make_x(7, torch.bfloat16), empty_i, empty_i, torch.empty(0), out)
    assert torch.equal(out[:7], torch.zeros(7, D))
    assert torch.equal(out[7:], torch.full((2, D), 3.0))  # rows past T are left alone


def available_isas() -> list[str]:
    f = features()
    return [isa for isa in ("avx512", "avx512_bf16", "amx") if f.get(isa)]


@pytest.mark.parametrize("isa", ["avx512", "avx512_bf16", "amx"])
@pytest.mark.parametrize("T", [7, 64])
def test_each_isa_path(native, isa, T, layers):
    if isa not in available_isas():
        pytest.skip(f"this CPU lacks {isa}")
    w = layers[torch.bfloat16]
    experts = CpuExperts([w], num_threads=2, backend="native", isa=isa, amx_min_tokens=2, spin_us=100)
    x = make_x(T, torch.bfloat16)
    tok, ids, wts = make_routes(T, 0.0)
    out = experts.forward(0, x, tok, ids, wts)
    stats = experts.last_stats()
    assert stats["isa"] == isa
    assert (stats["amx_experts"] > 0) == (isa == "amx")
    assert rel_err(out, torch_reference(w.w13, w.w2, x, tok, ids, wts)) < TOL


@pytest.mark.parametrize("d,f", [(250, 100), (64, 32), (40, 24)])
@pytest.mark.parametrize("wdtype,xdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.bfloat16), (torch.float32, torch.float32)],
                         ids=["bf16-bf16", "bf16w-fp32x", "fp32w-bf16x", "fp32-fp32"])
def test_odd_shapes_and_mixed_dtypes(native, d, f, wdtype, xdtype):
    """Sizes that are no multiple of 16/32 run on the vector kernels (masked tails); AMX
    takes only D, F multiples of 32 and falls back to them otherwise."""
    w = make_layer(wdtype, d=d, f=f, seed=3)
    experts = CpuExperts([w], num_threads=2, backend="native", amx_min_tokens=1, spin_us=100)
    for T in (1, 64):
        x = make_x(T, xdtype, d=d, seed=4)
        tok, ids, wts = make_routes(T, 0.5, seed=5)
        out = experts.forward(0, x, tok, ids, wts)
        assert rel_err(out, torch_reference(w.w13, w.w2, x, tok, ids, wts)) < TOL
        if d % 32 or f % 32 or wdtype != torch.bfloat16 or xdtype != torch.bfloat16:
            assert experts.last_stats()["amx_experts"] == 0


@pytest.mark.parametrize("isa", ["avx512", "avx512_bf16", "amx"])
def test_deterministic_across_calls_threads_and_down_modes(native, isa, layers):
    """Bitwise: the same call twice, on 1 and 2 threads, and through both down modes."""
    if isa not in available_isas():
        pytest.skip(f"this CPU lacks {isa}")
    w = layers[torch.bfloat16]
    x = make_x(64, torch.bfloat16)
    tok, ids, wts = make_routes(64, 0.5)
    results = []
    for threads in (1, 2):
        experts = CpuExperts([w], num_threads=threads, backend="native", isa=isa, amx_min_tokens=4, spin_us=100)
        for mode in (1, 2, 1):  # direct, scatter, direct
            experts._args[0].down_mode = mode
            results.append(experts.forward(0, x, tok, ids, wts).clone())
            assert experts.last_stats()["scatter"] == (mode == 2)
        experts.close()
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_repeated_submit_wait_across_layers(native):
    ws = {3: make_layer(torch.bfloat16, seed=10), 11: make_layer(torch.bfloat16, seed=11)}
    experts = CpuExperts(ws, num_threads=2, backend="native", spin_us=100)
    out = torch.empty(512, D)  # the engine's buffer: [T_max, D], reused by every call
    experts.reserve(max_routes=512 * K, max_tokens=512)
    assert experts.wait() is None  # nothing pending
    for i in range(24):
        layer = (3, 11)[i % 2]
        T = TOKENS[i % 4]
        x = make_x(T, torch.bfloat16, seed=i)
        tok, ids, wts = make_routes(T, HOT[i % 3], seed=i)
        experts.submit(layer, x, tok, ids, wts, out)
        with pytest.raises(RuntimeError, match="before wait"):
            experts.submit(layer, x, tok, ids, wts, out)
        experts.wait()
        assert experts.ready()
        ref = torch_reference(ws[layer].w13, ws[layer].w2, x, tok, ids, wts)
        assert rel_err(out[:T], ref) < TOL


def test_strided_x_duplicates_and_int64_routes(native, layers):
    w = layers[torch.bfloat16]
    big = make_x(10, torch.bfloat16, d=2 * D)
    x = big[:, :D]  # rows with stride 2D
    tok = torch.tensor([0, 3, 3, 3, 9, 9])
    ids = torch.tensor([1, 2, 2, 15, 0, 1])  # token 3 routes to expert 2 twice
    wts = torch.tensor([0.5, 0.25, 0.125, 1.0, -1.0, 2.0])
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100)
    out = experts.forward(0, x, tok, ids, wts)
    assert rel_err(out, torch_reference(w.w13, w.w2, x, tok, ids, wts)) < TOL
    assert torch.equal(out[1], torch.zeros(D))


def test_bad_inputs_raise_clear_errors(native, layers):
    w = layers[torch.bfloat16]
    experts = CpuExperts([w], num_threads=1, backend="native", spin_us=100)
    x = make_x(4, torch.bfloat16)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="token_idx"):
        experts.forward(0, x, torch.tensor([4]), torch.tensor([0]), one)
    with pytest.raises(ValueError, match="expert_ids"):
        experts.forward(0, x, torch.tensor([0]), torch.tensor([E]), one)
    with pytest.raises(ValueError, match="out must be"):
        experts.forward(0, x, torch.tensor([0]), torch.tensor([0]), one, torch.empty(2, D))
    with pytest.raises(ValueError, match="one length"):
        experts.forward(0, x, torch.tensor([0, 1]), torch.tensor([0]), one)
    out = experts.forward(0, x, torch.tensor([1]), torch.tensor([2]), one)  # still usable
    assert rel_err(out, torch_reference(w.w13, w.w2, x, torch.tensor([1]), torch.tensor([2]), one)) < TOL
    with pytest.raises(ValueError, match="not contiguous"):
        CpuExperts([ExpertWeights(w.w13.transpose(1, 2), w.w2)], backend="native")


def test_the_extension_builds_on_a_cpu_it_serves():
    """Where the CPU has AVX-512 and the tools are there, the native extension builds. Its tests skip when
    it does not (native_skip_reason), so a kernel that no longer compiles would otherwise pass CI as skips
    (session 48: templated tile registers, which the AMX intrinsics paste into the assembly, did not)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    if platform.machine() != "x86_64" or "avx512f" not in flags:
        pytest.skip("no AVX-512 here: the torch fallback serves")
    ext = build.load_cpu_extension()
    error = build.load_error() or ""
    if ext is None and ("no C++ compiler" in error or "Ninja" in error):
        pytest.skip(f"no build tools: {error}")
    assert ext is not None, error


def test_a_bench_report_says_which_policy_ran_on_plain_torch():
    from ostinato.bench.report import _cpu_note

    run = {"device": "cuda", "policies": {"ostinato": {"cpu_backend": "native"},
                                          "layers": {"cpu_backend": "torch (building the CPU extension failed: x)"}}}
    lines = _cpu_note(run)
    assert len(lines) == 1 and "layers: its CPU experts ran on plain torch" in lines[0] and "failed: x" in lines[0]
    assert _cpu_note({"device": "cuda", "policies": {"ostinato": {"cpu_backend": "native"}}}) == []


def test_fallbacks(monkeypatch, layers):
    monkeypatch.setattr(build, "_error", None)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert build.load_cpu_extension.__wrapped__() is None
    assert "compiler" in build.load_error()

    monkeypatch.setattr(ce_mod, "_native_unavailable", lambda isa: "no AVX-512 here")
    with pytest.warns(RuntimeWarning, match="plain torch, not the native kernels: no AVX-512 here"):
        experts = CpuExperts([layers[torch.float32]], backend="auto")
    assert experts.backend == "torch" and experts.fallback_reason == "no AVX-512 here"
    with pytest.raises(RuntimeError, match="no AVX-512 here"):
        CpuExperts([layers[torch.float32]], backend="native")


def test_default_workers_are_the_host_driven_layouts():
    """Without cpus, the pool takes the workers of a host-driven process's thread layout: every
    physical core but the caller's (which waits as the last worker)."""
    cpu = CpuExperts([make_layer(torch.float32, d=32, f=32, e=2)], backend="torch")
    assert cpu.cpus == process_layout().workers
    assert process_layout().host[0] not in cpu.cpus or process_layout().physical == 1
    with pytest.raises(ValueError, match="disagree"):
        CpuExperts([make_layer(torch.float32, d=32, f=32, e=2)], num_threads=3, backend="torch", cpus=[0])


def test_torch_backend_runs_on_its_own_threads():
    """The torch fallback computes on num_threads torch threads in its worker, whatever the
    runner's thread set (a CUDA runner keeps its own at one: engine/runner.py)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cpu = CpuExperts([make_layer(torch.float32, d=32, f=32, e=2)], num_threads=2, backend="torch")
        assert cpu._executor.submit(torch.get_num_threads).result() == 2
        cpu.close()
    finally:
        torch.set_num_threads(before)


def test_notify_announces_the_end_before_wait(native):
    """A call with notify stores its value once out is complete, with no wait() (a GPU stream spins
    on that word: hybrid.py's deferred combine); the next submit() settles it; an empty call
    announces at once; notify's word is checked."""
    import time

    w = make_layer(torch.bfloat16, seed=20)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100)
    out, word = torch.empty(512, D), torch.zeros(16, dtype=torch.int32)
    for i, (T, hot) in enumerate([(64, 0.5), (7, 0.0), (512, 0.5), (1, 1.0)], start=1):
        x = make_x(T, torch.bfloat16, seed=i)
        tok, ids, wts = make_routes(T, hot, seed=i)
        experts.submit(0, x, tok, ids, wts, out, notify=(word, i))  # the previous call is settled here
        assert experts._args[0].notify == 0  # the call's own copy announces; the layer's args (the graph worker's) do not
        deadline = time.monotonic() + 30
        while int(word[0]) != i:
            assert time.monotonic() < deadline, "the call never announced its end"
            time.sleep(1e-4)
        assert rel_err(out[:T], torch_reference(w.w13, w.w2, x, tok, ids, wts)) < TOL  # complete when announced
    experts.wait()
    experts.submit(0, x, tok, ids, wts, out)  # no notify: the word stays, and wait() is required again
    with pytest.raises(RuntimeError, match="before wait"):
        experts.submit(0, x, tok, ids, wts, out)
    experts.wait()
    assert int(word[0]) == 4
    with pytest.raises(ValueError, match="int32"):
        experts.submit(0, x, tok, ids, wts, out, notify=(word.float(), 5))
    assert experts.wait() is None  # the failed submit left nothing pending


def test_notify_needs_the_native_backend(layers):
    experts = CpuExperts([layers[torch.float32]], num_threads=1, backend="torch")
    x, (tok, ids, wts) = make_x(4, torch.float32), make_routes(4, 0.0)
    with pytest.raises(ValueError, match="native"):
        experts.submit(0, x, tok, ids, wts, torch.empty(4, D), notify=(torch.zeros(1, dtype=torch.int32), 1))
