"""The cost model: a decode step and the two prefill paths, predicted from a routing
profile, a residency and the constants `ostinato calibrate` measured (DESIGN.md, "Cost
model, calibrated inside the engine"). Pure functions; times in milliseconds.

Decode. In MoE layer l a token's GPU branch takes G_l (zero slots fix the shapes), its
CPU branch C_l(r) = gamma0_l for r = 0 cold routes and alpha_l + beta_l * r otherwise
(the host's time in the layer: the GPU branch launched, the handshake, the cold experts
computed; gamma0 is the handshake and bookkeeping of a layer without cold routes); the
branches overlap (on a machine without a GPU both run on the CPU, one after the
other, and a layer costs C + G instead), so

    step = dense + sum_l E[max(C_l(r_l), G_l)]      (a layer without cold experts: G_l)

with the expectation taken exactly over r_l = 0..K. `dense` is the rest of a step
(attention, norms, routers, head, launches), measured by calibrate.

The law of r_l, an approximation: the profile's decode counts give every expert e of
the layer a per-token route probability p_e = routes_e / tokens (sum_e p_e = K). A
token's K experts are modelled as a conditional Poisson draw, P(set) ∝ prod_{e in set}
w_e over sets of exactly K, with working weights w fitted so that every expert's
inclusion probability is its p_e (the maximum-entropy law over K-sets with those
marginals; `route_law`). Then E[r_l] = sum_{e cold} p_e exactly, as in the profile, and

    P(r) ∝ e_r(w_cold) * e_{K-r}(w_hot)

with e_j the elementary symmetric polynomials (computed exactly over r = 0..K). It keeps
the per-expert skew and the top-k constraint (r <= K, r <= #cold, K - r <= #hot) and
ignores correlations between experts beyond "exactly K". `method="binomial"` (each route
cold with the layer's cold share, independently) is the cruder option.

Prefill of n tokens, per layer (a pass costs the sum over layers):

    R(n)      = n * sum_{e cold} p_e                  expected cold routes
    X(n)      = sum_{e cold} 1 - (1 - p_e)^n           expected distinct cold experts
                                                      (tokens independent: saturates)
    split(n)  = max(alpha + beta_expert X(n) + beta_route R(n), G_hot(n))
                CPU time of the cold routes, in parallel with the GPU branch
    upload(n) = X(n) * expert_bytes / upload_bandwidth + G_all(n)

alpha + beta * R(n) alone (beta_expert = 0) would charge every cold route a whole expert
read, which overstates long passes, where one read serves all the routes of a pass to
that expert; calibrate fits alpha, beta_expert, beta_route (non-negative least squares)
to the host time of the split path in real passes and to the one-token points (X = R = r). G_hot / G_all are the GPU time of an n-token pass with the hot routes /
all routes, measured at a few n and interpolated linearly. Np is the one-switch rule
(`one_switch`) applied to the two curves.

The upload path's worth (`upload_path_value`): over the development sessions, what the paths that
use its flex slots save on their passes (`path_gains`, the measured curves: the upload path from Np,
the split with uploads over the sizes it pays at), against what those slots would save as hot experts
(the decode and prefill models above, with and without those experts). The planner keeps the path
only where the first is larger (planner/pipeline.py plan_upload_path).

Legend: L MoE layers, E experts per layer, K top-k, r cold routes of a token in a layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ostinato.layers.moe.hybrid import choose_path


def route_probs(counts: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Per-token route probability of every expert [E] (uniform K/E without counts)."""
    c = counts.double()
    E = c.numel()
    if tokens <= 0 or float(c.sum()) <= 0:
        return torch.full((E,), min(1.0, top_k / E), dtype=torch.float64)
    return (c / tokens).clamp(0.0, 1.0)


def esp(w: np.ndarray, upto: int) -> np.ndarray:
    """Elementary symmetric polynomials e_0..e_upto of w (all non-negative: no cancellation)."""
    e = np.zeros(upto + 1)
    e[0] = 1.0
    for wi in w:
        e[1:] = e[1:] + wi * e[:-1]
    return e


def _prefix_esp(w: np.ndarray, upto: int) -> np.ndarray:
    """[E + 1, upto + 1]: row i = esp of w[:i]."""
    out = np.zeros((w.size + 1, upto + 1))
    out[0, 0] = 1.0
    for i, wi in enumerate(w):
        out[i + 1] = out[i]
        out[i + 1, 1:] += wi * out[i, :-1]
    return out


def inclusion(w: np.ndarray, k: int) -> np.ndarray:
    """P(e selected) when k experts are drawn with P(set) ∝ prod_{e in set} w_e."""
    pre, suf = _prefix_esp(w, k), _prefix_esp(w[::-1], k)[::-1]  # suf row i = esp of w[i:]
    # e_{k-1} of everything but e = sum_j pre[e, j] * suf[e + 1, k - 1 - j]
    loo = np.einsum("ej,ej->e", pre[:-1, :k], suf[1:, :k][:, ::-1])
    return w * loo / pre[-1, k]


@dataclass(frozen=True)
class RouteLaw:
    """Conditional Poisson law of a layer's k selected experts: P(set) ∝ prod w_e over |set| = k
    (the maximum-entropy law over k-sets with the profile's per-expert route probabilities)."""

    w: np.ndarray  # [E] working weights (0 for never-routed and for always-routed experts)
    always: np.ndarray  # [E] bool: experts every token routes to
    k: int  # experts drawn besides the always-routed ones


def route_law(p: torch.Tensor, top_k: int, tol: float = 1e-9, max_iter: int = 20000) -> RouteLaw:
    """Working weights whose conditional-Poisson inclusion probabilities equal p (fixed point
    w <- w * p / inclusion(w), which converges for feasible p: 0 <= p <= 1, sum p = K). It
    converges slowly when some p is near 1: p = 0.998 of K = 3 needed a few thousand steps
    (0.1 s) to reach tol, where 1000 left the expected cold routes 4e-6 off."""
    p = p.double().numpy().copy()
    always = p >= 1.0 - 1e-12
    w = np.zeros_like(p)
    while True:
        k = top_k - int(always.sum())
        free = (p > 0) & ~always
        if k <= 0 or free.sum() < k:
            return RouteLaw(w, always, max(k, 0))
        q = p[free] * (k / p[free].sum())  # exact sum k (profiles cut at a context limit may miss a little)
        if (q < 1.0 - 1e-12).all():
            break
        always[np.flatnonzero(free)[q >= 1.0 - 1e-12]] = True  # rescaled to >= 1: always selected
    wf = q / (1.0 - q)
    for _ in range(max_iter):
        inc = inclusion(wf, k)
        if np.abs(inc - q).max() < tol:
            break
        wf = wf * q / np.maximum(inc, 1e-300)
    w[free] = wf
    return RouteLaw(w, always, k)


def binomial(n: int, q: float) -> torch.Tensor:
    return torch.tensor([math.comb(n, r) * q**r * (1 - q) ** (n - r) for r in range(n + 1)], dtype=torch.float64)


def cold_route_distribution(p: torch.Tensor, hot: torch.Tensor, top_k: int, method: str = "conditional",
                            law: RouteLaw | None = None) -> torch.Tensor:
    """Law of the number of cold routes of one token in a layer, [K + 1].

    p [E]: per-token route probabilities; hot [E] bool: resident experts; law: route_law(p, K)
    when already computed (it does not depend on the residency).
    """
    cold = ~hot
    if method == "binomial":
        q = float(p[cold].sum() / p.sum()) if float(p.sum()) > 0 else float(cold.double().mean())
        return binomial(top_k, min(max(q, 0.0), 1.0))
    if method != "conditional":
        raise ValueError(f"method must be 'conditional' or 'binomial', not {method!r}")
    law = law or route_law(p, top_k)
    c = cold.numpy()
    shift = int((law.always & c).sum())  # always-routed cold experts: r is at least this
    joint = esp(law.w[c], law.k) * esp(law.w[~c], law.k)[::-1]  # r cold and k - r hot among the rest
    dist = torch.zeros(top_k + 1, dtype=torch.float64)
    if joint.sum() <= 0:  # no k-set possible (fewer routed experts than k): the binomial
        return cold_route_distribution(p, hot, top_k, "binomial")
    dist[shift:shift + law.k + 1] = torch.from_numpy(joint / joint.sum())
    return dist


def expected_cold_routes(dist: torch.Tensor) -> float:
    return float((dist * torch.arange(dist.numel(), dtype=torch.float64)).sum())


def dense_ms(calibration: dict, context: float) -> float:
    """The non-MoE part of a decode step at a context of this many tokens."""
    c = calibration
    return c.get("dense_step_ms", 0.0) + c.get("dense_ms_per_1k_context", 0.0) * max(
        0.0, context - c.get("dense_context", 0)) / 1e3


@dataclass(frozen=True)
class LayerCost:
    """Calibrated decode costs of one MoE layer, ms."""

    G: float
    gamma0: float
    alpha: float
    beta: float
    overlapped: bool = True  # the branches run concurrently (a GPU); else one after the other

    def cpu(self, r: int) -> float:
        return self.gamma0 if r == 0 else self.alpha + self.beta * r

    def layer(self, r: int) -> float:
        return max(self.cpu(r), self.G) if self.overlapped else self.cpu(r) + self.G


def expected_layer_time(dist: torch.Tensor, cost: LayerCost, has_cold: bool = True) -> float:
    """E[max(C(r), G)] exactly over r = 0..K (a layer without cold experts runs the GPU only)."""
    if not has_cold:
        return cost.G
    return sum(float(dist[r]) * cost.layer(r) for r in range(dist.numel()))


def layer_costs(calibration: dict, layers: list[int]) -> dict[int, LayerCost]:
    """LayerCost of every layer from a residency's calibration (global values where a layer lacks
    its own; the graph fit's CPU-branch constants, where the calibration has one, for every layer,
    with the GPU branch as timed inside a captured graph)."""
    glob = calibration.get("global") or {}
    per = calibration.get("layers") or {}
    graph = calibration.get("graph_fit") or {}  # a graph decode: the CPU branch as the worker serves it
    out, overlapped = {}, calibration.get("overlapped", True)
    for l in layers:
        d = {**glob, **(per.get(str(l)) or per.get(l) or {}), **graph}
        g_key = "G_graph_ms" if graph and "G_graph_ms" in d else "G_ms"  # a graph step pays no launches
        try:
            out[l] = LayerCost(d[g_key], d["gamma0_ms"], d["alpha_ms"], d["beta_ms"], overlapped)
        except KeyError as e:
            raise ValueError(f"the calibration lacks {e.args[0]!r} for layer {l}: run `ostinato calibrate`") from None
    return out


@dataclass
class StepPrediction:
    total_ms: float
    dense_ms: float
    layer_ms: dict[int, float] = field(default_factory=dict)
    cold_routes: dict[int, float] = field(default_factory=dict)  # E[r_l] per token

    @property
    def moe_ms(self) -> float:
        return sum(self.layer_ms.values())

    @property
    def cold_routes_per_layer(self) -> float:
        return sum(self.cold_routes.values()) / max(1, len(self.cold_routes))


def route_laws(counts: dict[int, torch.Tensor], tokens: int, top_k: int) -> dict[int, tuple[torch.Tensor, RouteLaw]]:
    """(p, law) of every layer: computed once per profile, shared by the residencies compared."""
    out = {}
    for l, c in counts.items():
        p = route_probs(c, tokens, top_k)
        out[l] = (p, route_law(p, top_k))
    return out


def predict_decode_step(counts: dict[int, torch.Tensor], tokens: int, hot: dict[int, list[int]],
                        costs: dict[int, LayerCost], top_k: int, dense_ms: float = 0.0,
                        method: str = "conditional", laws: dict | None = None) -> StepPrediction:
    """Expected decode-step time of a residency, from decode route counts over `tokens` tokens."""
    laws = laws or route_laws({l: counts[l] for l in costs}, tokens, top_k)
    pred = StepPrediction(dense_ms, dense_ms)
    for l, cost in costs.items():
        p, law = laws[l]
        mask = torch.zeros(p.numel(), dtype=torch.bool)
        mask[hot.get(l, [])] = True
        dist = cold_route_distribution(p, mask, top_k, method, law)
        pred.layer_ms[l] = expected_layer_time(dist, cost, has_cold=not bool(mask.all()))
        pred.cold_routes[l] = expected_cold_routes(dist)
    pred.total_ms = dense_ms + pred.moe_ms
    return pred


def read_gbps(cal: dict) -> float | None:
    """The host read bandwidth the bound divides cold bytes by, GB/s: the faster of the host
    read probe (the native pool's own where it has one, planner/measure/transfers.py
    host_read_gbps; calibrations before session 16 hold a torch sum's, 78 GB/s on the H200
    machine) and the CPU branch's own rate per cold route (expert bytes / beta: 133 GB/s there),
    so that the bound stays below every step the kernels could have made."""
    eb, probe = cal.get("expert_bytes"), cal.get("host_read_gbps")
    beta = (cal.get("graph_fit") or cal.get("global") or {}).get("beta_ms")
    rates = [r for r in (probe, eb / (beta * 1e6) if eb and beta else None) if r]
    return max(rates) if rates else None


def decode_bound(pred: StepPrediction, costs: dict[int, LayerCost], expert_bytes: int, read_gbps: float) -> float:
    """BENCHMARK.md's bound on a decode step, ms: the dense part plus, per layer, the larger of
    the GPU branch and the time to read the layer's expected cold experts once from host
    memory at the measured read bandwidth (no CPU overheads, no handshake)."""
    read_ms = expert_bytes / (read_gbps * 1e6)  # one expert's bytes at GB/s, in ms
    return pred.dense_ms + sum(max(costs[l].G, pred.cold_routes[l] * read_ms) for l in pred.layer_ms)


def pool_saving(counts, tokens, hot_small, hot_big, costs, top_k, dense_ms=0.0, method="conditional"):
    """Predicted ms per step saved by the bigger pool: (saving, small, big)."""
    laws = route_laws({l: counts[l] for l in costs}, tokens, top_k)
    small = predict_decode_step(counts, tokens, hot_small, costs, top_k, dense_ms, method, laws)
    big = predict_decode_step(counts, tokens, hot_big, costs, top_k, dense_ms, method, laws)
    return small.total_ms - big.total_ms, small, big


def expected_distinct(p_cold: torch.Tensor, n: float) -> float:
    """Expected distinct experts among n independent tokens: sum_e 1 - (1 - p_e)^n."""
    return float((1.0 - (1.0 - p_cold.double()) ** n).sum())


def interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear through (xs, ys), extended linearly beyond both ends."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class PassCosts:
    """Calibrated constants of n-token passes, per layer, ms."""

    alpha: float
    beta_expert: float
    beta_route: float
    upload_gbps: float
    expert_bytes: int
    sizes: tuple[int, ...]
    gpu_hot_ms: tuple[float, ...]
    gpu_all_ms: tuple[float, ...]
    overlapped: bool = True

    @classmethod
    def from_calibration(cls, cal: dict) -> "PassCosts":
        cp, ps = cal["cpu_pass"], cal["passes"]
        return cls(cp["alpha_ms"], cp["beta_expert_ms"], cp["beta_route_ms"], cal["upload_gbps"], cal["expert_bytes"],
                   tuple(ps["sizes"]), tuple(ps["gpu_hot_ms"]), tuple(ps["gpu_all_ms"]), cal.get("overlapped", True))

    def split(self, n: float, routes: float, distinct: float) -> float:
        cpu = self.alpha + self.beta_expert * distinct + self.beta_route * routes if routes > 0 else 0.0
        gpu = interp(n, list(self.sizes), list(self.gpu_hot_ms))
        return max(cpu, gpu) if self.overlapped else cpu + gpu

    def upload(self, n: float, distinct: float) -> float:
        copy = distinct * self.expert_bytes / (self.upload_gbps * 1e9) * 1e3
        return copy + interp(n, list(self.sizes), list(self.gpu_all_ms))


def pass_costs(n: int, probs: dict[int, torch.Tensor], hot: dict[int, list[int]], pc: PassCosts) -> tuple[float, float]:
    """(split, upload) ms of an n-token pass, averaged over the layers of `probs` (per-token p_e)."""
    split = upload = 0.0
    for l, p in probs.items():
        cold = torch.ones(p.numel(), dtype=torch.bool)
        cold[hot.get(l, [])] = False
        pc_ = p[cold]
        routes, distinct = n * float(pc_.sum()), expected_distinct(pc_, n)
        split += pc.split(n, routes, distinct)
        upload += pc.upload(n, distinct)
    k = max(1, len(probs))
    return split / k, upload / k


def one_switch(sizes: list[int], split: list[float], upload: list[float]) -> tuple[int | None, int]:
    """Np by the one-switch rule: the smallest measured n from which upload is cheaper at
    every larger measured n. -> (Np, number of times the cheaper path changes along n).

    Monotone curves cross once (split grows with cold routes, upload with distinct cold
    experts, which saturate), so the paths switch once, at Np. On noisy curves that
    cross several times this is the last crossing; the count says so. Np is None when
    upload is not cheaper at the largest n.
    """
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    cheaper = [upload[i] < split[i] for i in order]
    crossings = sum(a != b for a, b in zip(cheaper, cheaper[1:]))
    if not cheaper or not cheaper[-1]:
        return None, crossings
    i = len(cheaper) - 1
    while i > 0 and cheaper[i - 1]:
        i -= 1
    return sizes[order[i]], crossings


def model_threshold(probs: dict[int, torch.Tensor], hot: dict[int, list[int]], pc: PassCosts,
                    sizes: list[int]) -> tuple[int | None, int, list[tuple[int, float, float]]]:
    """Np of the model on `sizes`: (Np, crossings, [(n, split, upload)])."""
    curve = [(n, *pass_costs(n, probs, hot, pc)) for n in sizes]
    np_, crossings = one_switch([c[0] for c in curve], [c[1] for c in curve], [c[2] for c in curve])
    return np_, crossings, curve


def prefill_passes(prompts: list[int], chunk: int) -> dict[int, int]:
    """{tokens: count} of the passes the runner makes for prompts of these sizes (chunks of `chunk`)."""
    out: dict[int, int] = {}
    for n in prompts:
        full, rest = divmod(int(n), chunk)
        for size, k in ((chunk, full), (rest, 1 if rest else 0)):
            if k:
                out[size] = out.get(size, 0) + k
    return out


def _count(x: float) -> int | float:
    """A number of passes as a report gives it: whole, or to a tenth (a learned profile's)."""
    return int(x) if float(x).is_integer() else round(x, 1)


def profile_passes(prof, chunk: int) -> dict[int, float] | None:
    """The prefill passes of a profile (RouteCounts) by size: those it counted (a served tally's, a
    learned profile's: planner/served.py), else those its prompts make in chunks of `chunk`; None
    where it has neither (an older profile)."""
    if prof.passes is not None:
        return prof.passes
    return prefill_passes(prof.prompts, chunk) if prof.prompts is not None else None


def path_gains(cal: dict, passes: dict[int, int], mixed=None) -> dict:
    """What the paths that use the flex slots save over the split path, per MoE layer with cold
    experts, on passes {tokens: count} (prefill_passes), ms in all, from the calibration's measured
    curves (passes: split_ms, upload_ms, mixed_ms, and split_paired_ms, the split path timed in
    pairs with mixed_ms, where the calibration has it) interpolated at each pass's size. Each pass takes
    the engine's path (layers/moe/hybrid.py choose_path): `plain` is the upload path at Np and above
    (the calibration's upload_threshold), else the split path; the split with uploads (`mixed`, a
    MixedPass) takes over where it applies. The two parts add up to split minus the path taken:

      upload   split - plain, on the passes of at least Np tokens;
      mixed    plain - mixed, on the passes `mixed` applies to.

    -> {"upload_ms", "mixed_ms", "passes_at_np", "passes_mixed"}."""
    np_, p = cal.get("upload_threshold"), cal.get("passes") or {}
    out = {"upload_ms": 0.0, "mixed_ms": 0.0, "passes_at_np": 0, "passes_mixed": 0}
    if not p.get("sizes"):
        return out
    sizes = [float(n) for n in p["sizes"]]
    at = lambda key, n: interp(n, sizes, list(p[key]))  # noqa: E731
    paired = "split_paired_ms" in p  # the split path as timed beside the split with uploads
    for n, k in passes.items():
        split = at("split_ms", n)
        plain = split
        if choose_path(n, True, np_, None) == "upload":
            plain = at("upload_ms", n)
            out["upload_ms"] += k * (split - plain)
            out["passes_at_np"] += k
        if mixed is not None and mixed.applies(n):
            ref = at("split_paired_ms", n) if paired and plain == split else plain
            out["mixed_ms"] += k * (ref - at("mixed_ms", n))
            out["passes_mixed"] += k
    return out


def split_prefill_ms(cal: dict, prof, passes: dict[int, float], hot: dict[int, list[int]], top_k: int) -> float:
    """A profile's prefill passes ({tokens: count}, profile_passes) all on the split path under a
    residency, ms in all over its MoE layers, by the prefill model (cpu_pass constants, the GPU
    branch's measured curve)."""
    layers = sorted(prof.prefill)
    pc = PassCosts.from_calibration(cal)
    probs = {l: route_probs(prof.prefill[l], prof.tokens["prefill"], top_k) for l in layers}
    return sum(k * len(layers) * pass_costs(n, probs, hot, pc)[0] for n, k in passes.items())


def upload_path_value(cal: dict, prof, passes: dict[int, int], hot: dict[int, list[int]],
                      bigger: dict[int, list[int]], top_k: int, mixed=None) -> dict:
    """What the upload path is worth over a development workload, ms in all, against the plan that
    spends its flex slots' bytes on more hot experts (`bigger`, a superset of `hot`):

      gain     what the paths that use the flex slots save on its passes (path_gains: the upload
               path and the split with uploads, `mixed`, a MixedPass or None), times the MoE
               layers with cold experts;
      cost     what the experts only `bigger` keeps resident would cost on the CPU: in decode,
               tokens x (step(hot) - step(bigger)) by the decode model; in prefill, every pass's
               split path with `hot` against `bigger` by the prefill model (cpu_pass constants).

    prof: the development profile (RouteCounts: decode and prefill counts and tokens); passes:
    {tokens: count} of its prefill passes (prefill_passes)."""
    layers = sorted(prof.decode)
    E = prof.decode[layers[0]].numel() if layers else 0
    with_cold = sum(1 for l in layers if len(hot.get(l, [])) < E)
    g = path_gains(cal, passes, mixed)
    costs = layer_costs(cal, layers)
    laws = route_laws(prof.decode, prof.tokens["decode"], top_k)
    step = {name: predict_decode_step(prof.decode, prof.tokens["decode"], h, costs, top_k, laws=laws)
            for name, h in (("hot", hot), ("bigger", bigger))}
    decode = prof.tokens["decode"] * (step["hot"].total_ms - step["bigger"].total_ms)
    prefill = 0.0
    if (cal.get("passes") or {}).get("sizes") and cal.get("cpu_pass"):
        prefill = split_prefill_ms(cal, prof, passes, hot, top_k) - split_prefill_ms(cal, prof, passes, bigger, top_k)
    gain_upload, gain_mixed = with_cold * g["upload_ms"], with_cold * g["mixed_ms"]
    return {"gain_ms": gain_upload + gain_mixed, "gain_upload_ms": gain_upload, "gain_mixed_ms": gain_mixed,
            "cost_ms": decode + prefill, "cost_decode_ms": decode, "cost_prefill_ms": prefill,
            "np": cal.get("upload_threshold"), "mixed_from": mixed.min_tokens if mixed is not None else None,
            "mixed_to": mixed.max_tokens if mixed is not None else None,
            "passes": _count(sum(passes.values())), "passes_at_np": _count(g["passes_at_np"]),
            "passes_mixed": _count(g["passes_mixed"]),
            "largest_pass": max(passes, default=0), "decode_tokens": prof.tokens["decode"],
            "cold_routes_per_token_layer": [step["hot"].cold_routes_per_layer, step["bigger"].cold_routes_per_layer]}


def expert_values(cal: dict, prof, passes: dict[int, int], top_k: int) -> dict[int, torch.Tensor] | None:
    """What keeping each expert resident saves over a development workload, ms, to first order
    (each expert on its own, the other experts as they are): the cost of its routes on the CPU,
    by the calibrated constants, on the passes the engine makes,

      decode    its decode routes x beta_l (the CPU branch's cost of one cold route);
      prefill   on every split pass of n tokens (below Np): beta_expert x P(a pass reads it) +
                beta_route x n p_e, with P = 1 - (1 - p_e)^n; on an upload pass (Np and above):
                P x its upload time.

    A decode route costs 31x a prefill route on the H200 machine (session 16: 70.9 against 2.3
    µs), and most prefill routes fall on passes that read every expert of the layer anyway, so a
    fill by these values keeps the experts decode uses where a fill by route counts keeps those
    long prefills use. prof: a RouteCounts with prompt sizes; passes: prefill_passes of them.
    None where the calibration lacks the decode constants or the prefill ones (cpu_pass), or priced
    a cold route at nothing in either phase (a fit that found no cost: the values would rank by one
    phase alone, or tie)."""
    if not cal.get("global") or not cal.get("cpu_pass") or not cal.get("upload_gbps"):
        return None
    layers = sorted(prof.decode)
    costs, pc = layer_costs(cal, layers), PassCosts.from_calibration(cal)
    if min(c.beta for c in costs.values()) <= 0 or pc.beta_expert + pc.beta_route <= 0:
        return None
    np_ = cal.get("upload_threshold")
    upload_ms = pc.expert_bytes / (pc.upload_gbps * 1e6)
    out = {}
    for l in layers:
        v = prof.decode[l].double() * costs[l].beta
        p = route_probs(prof.prefill[l], prof.tokens["prefill"], top_k)
        for n, k in passes.items():
            read = 1.0 - (1.0 - p) ** n
            if choose_path(n, True, np_, None) == "upload":
                v = v + k * read * upload_ms
            else:
                v = v + k * (pc.beta_expert * read + pc.beta_route * n * p)
        out[l] = v
    return out
