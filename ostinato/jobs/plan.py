"""Planner subcommands: profile (count routes), skew (the hot-share figure), plan (capacity
test + fill -> residency file), calibrate (cost-model constants measured in the engine).

Each command imports what it runs inside its handler, as the other command modules do: the
argument parsers load with `ostinato --help` and every command, the engine only with a command
that needs it."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ostinato.config import ConfigError
from ostinato.model_args import add_margin_args, add_model_args, margin_settings, placement_settings, runner_settings


def _sessions(spec: str | None, limit: int | None):
    from ostinato.sessions.read import load_sessions

    sessions = load_sessions(spec or "embedded")
    return sessions[:limit] if limit else sessions


def cmd_profile(a) -> int:
    from ostinato.load import load_engine
    from ostinato.planner.run_profile import profile_sessions

    loaded = load_engine(a.model, runner_settings(a), placement_settings(a))
    counts = profile_sessions(loaded, _sessions(a.sessions, a.max_sessions))
    counts.save(a.output)
    print(f"profiled {counts.sessions} sessions: {counts.tokens['prefill']} prompt and "
          f"{counts.tokens['decode']} output tokens, longest {counts.max_tokens} -> {a.output}")
    print(skew_summary(counts))
    return 0


def skew_summary(counts) -> str:
    """Share of each layer's routes on its own top 10% / 40% experts: min / median / max over layers."""
    parts = []
    for frac in (0.10, 0.40):
        v = sorted(counts.layer_top_shares(frac).values())
        if v:
            parts.append(f"top {100 * frac:.0f}%: {100 * v[0]:.1f}% / {100 * v[len(v) // 2]:.1f}% / "
                         f"{100 * v[-1]:.1f}%")
    return (f"skew per layer (share of a layer's routes on its own top experts, min / median / max over "
            f"{len(counts.prefill)} layers): " + "; ".join(parts))


def cmd_skew(a) -> int:
    from ostinato.sessions.read import split_sessions, spread
    from ostinato.load import load_engine
    from ostinato.planner.skew import (content_report, hot_share, persistence_report, spread_report, top_experts,
                                       trace_sessions)

    loaded = load_engine(a.model, runner_settings(a), placement_settings(a))
    dev, held = split_sessions(_sessions(a.sessions, None))
    if a.max_sessions:
        dev, held = spread(dev, a.max_sessions), spread(held, a.max_sessions)
    cd, _ = trace_sessions(loaded, dev, desc="dev")
    ch, sh = trace_sessions(loaded, held, desc="held-out")
    if a.save_profiles:
        cd.save(f"{a.save_profiles}-dev.json")
        ch.save(f"{a.save_profiles}-held-out.json")
    result = {"model": a.model, "dev_sessions": len(dev), "held_out_sessions": len(held), "figures": []}
    for frac in a.fraction:
        for phase in ("all", "decode", "prefill"):
            share, per_layer = hot_share(cd.total("all"), ch.total(phase), frac)
            spread_ = spread_report(per_layer)
            result["figures"].append({"top_fraction": frac, "held_out_phase": phase, "share": round(share, 4)} | spread_)
            rng = ", ".join(f"layers {x}-{y}: {100 * s:.1f}%" for x, y, s in spread_["layer_ranges"])
            print(f"top {100 * frac:.0f}% of experts (by dev routes) -> {100 * share:.1f}% of held-out {phase} routes "
                  f"(per layer min / median / max {100 * spread_['min_layer']:.1f}% / "
                  f"{100 * spread_['median_layer']:.1f}% / {100 * spread_['max_layer']:.1f}%; {rng})")
    pers = result["persistence"] = persistence_report(sh, loaded.runner.config.num_experts_per_tok)
    print(f"held-out consecutive tokens share {100 * pers['overlap']:.1f}% of their experts "
          f"(independent draws with the same frequencies: {100 * pers['independent']:.1f}%)")
    cont = result["content"] = content_report(sh, top_experts(cd.total("all"), a.fraction[-1]))
    by = ", ".join(f"{c} {100 * v['share']:.1f}%" for c, v in cont["share_by_class"].items())
    print(f"by token class, held-out routes on the top {100 * a.fraction[-1]:.0f}%: {by}; "
          f"class divergence (TV) {cont['class_divergence']:.3f}")
    print(json.dumps(result))
    return 0


def _plan_profile(a, source):
    """The development profile: from --profile, profiled now from --sessions (on an engine with no
    expert resident, under --gpu-memory if given: jobs/serve_plan.py), or none."""
    from ostinato.engine.routes import RouteCounts

    if a.profile:
        return RouteCounts.load(a.profile, source.config), a.profile
    if a.sessions:
        import tempfile

        from ostinato.config import parse_bytes
        from ostinato.engine.placement import PlacementSettings
        from ostinato.engine.runner import RunnerSettings
        from ostinato.jobs.serve_plan import load_cold
        from ostinato.planner.run_profile import profile_sessions
        from ostinato.policies.factory import release

        settings = RunnerSettings(device=_device(a), dtype=a.dtype, cpu_threads=a.cpu_threads, max_context=a.max_context)
        place = PlacementSettings(gpu_memory=parse_bytes(a.gpu_memory) if a.gpu_memory else None,
                                  experts=getattr(a, "experts", "native"))
        with tempfile.TemporaryDirectory() as tmp:
            loaded = load_cold(a.model, source, settings, place, Path(tmp) / "cold.json")
        prof = profile_sessions(loaded, _sessions(a.sessions, None))
        path = f"{a.output}.profile.json"
        prof.save(path)
        release(loaded)
        del loaded
        return prof, path
    if a.hot_fraction in (0.0, 1.0) and not a.gpu_memory:
        return None, None
    raise ValueError("give a development profile (--profile, from `ostinato profile`) or --sessions to profile")


def _device_names(a) -> list[str]:
    """--devices as a list (one name: --device; none: the default device)."""
    from ostinato.engine.devices import parse_devices

    if a.devices:
        return parse_devices(a.devices)
    return [a.device] if a.device else []


def _device(a) -> str | None:
    names = _device_names(a)
    return names[0] if names else None


def _route_report(name: str, prof, hot: dict[int, list[int]], num_layers: int, top_k: int) -> dict:
    """Hot share of a profile's routes and expected cold routes per decode token and layer, printed."""
    from ostinato.planner.pipeline import route_report

    r = route_report(prof, hot, num_layers)
    print(f"{name} routes on the GPU: {100 * r['hot_share']:.1f}% (decode {100 * r['decode_hot_share']:.1f}%); "
          f"expected cold routes per decode token and layer: {r['cold_routes_per_token_layer']:.2f} of {top_k}")
    return r


def _pool_size(a, cfg, counts, prof, device, formats):
    """The pool of a one-device plan (planner/pipeline.py), with the capacity test printed;
    formats: the block formats the GPU keeps (loader.build.weight_formats)."""
    from ostinato.config import parse_bytes
    from ostinato.engine.runner import RunnerSettings
    from ostinato.planner.capacity import fmt_bytes
    from ostinato.planner.pipeline import size_pool

    dtype = RunnerSettings(device=device, dtype=a.dtype).torch_dtype(cfg.torch_dtype)
    size = size_pool(cfg, counts, dtype, gpu_memory=parse_bytes(a.gpu_memory) if a.gpu_memory else None,
                     hot_fraction=a.hot_fraction, kv_tokens=a.max_context or (prof.max_tokens if prof else 0),
                     capacity=_capacity_settings(a), formats=formats)
    cap = size.capacity
    if cap is not None:
        print(f"capacity test, --gpu-memory {fmt_bytes(cap.budget)} ({cap.dtype}, one expert "
              f"{fmt_bytes(cap.expert_bytes)}; the budget holds {cap.max_hot_slots} hot experts):")
        for what, n in cap.table():
            print(f"  {what:<44} {fmt_bytes(n):>11}")
        print(f"  serve with --max-context {cap.kv_tokens} (the KV cache this plan holds)")
    elif size.max_flex is not None:
        print(f"flex slots: at most {size.max_flex} per expert format group (--max-flex)")
    return size


def _capacity_settings(a):
    from ostinato.planner.capacity import CapacitySettings

    return CapacitySettings(**margin_settings(a), prefill_chunk=a.prefill_chunk,
                            attention_score_share=a.attention_scores, max_flex=a.max_flex, flex_share=a.flex_share)


def _verify(a, res, cap, device) -> None:
    from ostinato.planner.capacity import fmt_bytes
    from ostinato.verify import verify_capacity

    v = verify_capacity(a.model, a.output, cap, a.cpu_threads, device, a.dtype, getattr(a, "experts", "native"))
    res.capacity["verified"] = v
    res.save(a.output)
    if "skipped" in v:
        print(f"verification skipped: {v['skipped']}")
    elif not v["ok"]:
        raise ConfigError(f"verification failed: the longest request ({v['tokens']} tokens) "
                          f"{v['error'] or 'peaked at ' + fmt_bytes(v['peak_allocated'])} under the "
                          f"{fmt_bytes(cap.budget)} cap; plan with a larger --margin")
    else:
        print(f"verified: the largest pass of a {v['tokens']}-token request peaked at "
              f"{fmt_bytes(v['peak_allocated'])} allocated ({fmt_bytes(v['peak_reserved'])} reserved; the plan "
              f"expected at most {fmt_bytes(v['planned'])}) under the {fmt_bytes(cap.budget)} cap")


def cmd_plan(a) -> int:
    from ostinato.engine.residency import Residency, model_fingerprint
    from ostinato.engine.routes import RouteCounts
    from ostinato.loader.build import weight_formats
    from ostinato.sources import open_source
    from ostinato.planner.pipeline import plan_residency

    if a.from_served:
        return plan_from_served(a)
    if a.gpu_memory is None and a.hot_fraction is None:
        raise ValueError("give --gpu-memory (size the pool by the capacity test) or --hot-fraction")
    if a.hot_fraction is not None and not 0.0 <= a.hot_fraction <= 1.0:
        raise ValueError(f"--hot-fraction must be in [0, 1], got {a.hot_fraction}")
    names = _device_names(a)
    device = names[0] if names else None
    source = open_source(a.model)
    cfg = source.config
    formats = weight_formats(source, getattr(a, "experts", "native"))  # what the engine will keep
    L, E, K = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok
    prof, prof_path = _plan_profile(a, source)
    counts = prof.total("all") if prof else {l: torch.zeros(E) for l in cfg.moe_layers}
    profile = {"path": prof_path, "sessions": prof.sessions if prof else 0,
               "tokens": prof.tokens if prof else {}, "max_tokens": prof.max_tokens if prof else 0}
    notes = {"hot_fraction": a.hot_fraction} if a.hot_fraction is not None else {}
    cap = None
    if len(names) > 1:  # one pool per GPU, each planned for its own layers under its own cap
        hot, devices, budget, capacity, max_flex = _plan_split(a, cfg, counts, prof, names, formats)
        res = Residency(model_fingerprint(source), E, hot, devices=devices, gpu_memory=budget, profile=profile,
                        capacity=capacity, notes=notes, max_flex=max_flex)
    else:
        size = _pool_size(a, cfg, counts, prof, device, formats)
        cap = size.capacity
        res = plan_residency(source, counts, size, devices={device: cfg.moe_layers} if device else {},
                             profile=profile, notes=notes)
        hot = res.hot
    print(f"{res.hot_count} hot experts of {L * E} ({100 * res.hot_count / (L * E):.1f}%) -> {a.output}")
    report = {"hot_experts": res.hot_count}
    if prof is not None:
        report["development"] = _route_report("development", prof, hot, L, K)
        if a.held_out:
            report["held-out"] = _route_report("held-out", RouteCounts.load(a.held_out), hot, L, K)
    res.notes["report"] = report
    res.save(a.output)
    if cap and not a.no_verify:
        _verify(a, res, cap, device)
    elif len(names) > 1 and a.gpu_memory and not a.no_verify:
        print("verification skipped: the run under the cap is measured on one device only (not yet per device)")
    return 0


def plan_from_served(a) -> int:
    """The plan again, from the routes served with it (planner/served.py), for the same cap and
    context (or the same share of experts, for a plan sized by one); the calibration is carried over.
    Says how the share of the served routes on the GPU changes."""
    import dataclasses
    import shutil

    from ostinato.config import parse_bytes
    from ostinato.engine.residency import Residency, measured
    from ostinato.engine.routes import RouteCounts
    from ostinato.engine.runner import RunnerSettings
    from ostinato.loader.build import weight_formats
    from ostinato.sources import open_source
    from ostinato.planner.capacity import CapacitySettings
    from ostinato.planner.pipeline import plan_residency, route_report, size_pool
    from ostinato.planner.served import ServedRoutes, learned_profile, served_path

    old = Residency.load(a.from_served)
    served = ServedRoutes(served_path(a.from_served))
    if served.counts is None:
        raise ConfigError(f"{served.path}: no routes served with {a.from_served} yet (serve with it first)")
    if len(old.devices) > 1:
        raise ConfigError("--from-served plans one device; plan a split model with --devices and --profile")
    source = open_source(a.model)
    old.check(source)
    cfg = source.config
    dev_path = (old.profile or {}).get("path")
    dev = RouteCounts.load(dev_path) if dev_path and Path(dev_path).is_file() else None
    prof = learned_profile(dev, served, a.prefill_chunk)
    counts = prof.total("all")
    dtype = RunnerSettings(device=_device(a), dtype=a.dtype).torch_dtype(cfg.torch_dtype)
    cap = parse_bytes(a.gpu_memory) if a.gpu_memory else old.gpu_memory
    kv = a.max_context or old.capacity.get("kv_tokens") or served.counts.max_tokens
    total = len(cfg.moe_layers) * cfg.num_experts
    formats = weight_formats(source, getattr(a, "experts", "native"))
    # the flex bound: --max-flex, else by the share of the new pool; a plan sized by a share of experts has
    # no pool's bytes to take a share of, and keeps the old plan's bound
    flex = CapacitySettings(max_flex=a.max_flex, flex_share=a.flex_share)
    if cap:
        size = size_pool(cfg, counts, dtype, gpu_memory=cap, kv_tokens=kv, capacity=flex, formats=formats)
    else:
        flex = dataclasses.replace(flex, max_flex=old.max_flex if a.max_flex is None else a.max_flex)
        size = size_pool(cfg, counts, dtype, hot_fraction=old.hot_count / total, kv_tokens=kv, capacity=flex,
                         formats=formats)
    res = plan_residency(source, counts, size, devices=old.devices, gpu_memory=cap,
                         profile=dict(old.profile) | {"counts": f"{served.served_tokens} served tokens and the "
                                                      f"development profile at weight {served.dev_weight():.4f}"},
                         notes=dict(old.notes))
    # the old plan's decisions go: this plan is filled again by time saved and its upload path decided on the
    # learned routes and passes (served.py learned_profile)
    res.calibration = measured(old.calibration)
    if res.calibration.get("global") and dev is not None:
        res = _decide_upload_path(res, res.calibration, prof, counts, source, dtype, a.prefill_chunk,
                                  getattr(a, "experts", "native"))
    L = len(cfg.moe_layers)
    before, after = route_report(served.counts, old.hot, L), route_report(served.counts, res.hot, L)
    res.notes["report"] = dict(res.notes.get("report") or {}) | {"served": after, "served_before": before}
    if dev is not None:
        res.notes["report"]["development"] = route_report(dev, res.hot, L)
    res.save(a.output)
    if Path(a.output).resolve() != Path(a.from_served).resolve():  # the new plan learns on from here
        shutil.copyfile(served.path, served_path(a.output))
    print(f"{res.hot_count} hot experts of {total} ({100 * res.hot_count / total:.1f}%), planned from "
          f"{served.served_tokens} served tokens -> {a.output}")
    print(f"served routes on the GPU: {100 * before['hot_share']:.1f}% with the old plan -> "
          f"{100 * after['hot_share']:.1f}% with the new (decode {100 * before['decode_hot_share']:.1f}% -> "
          f"{100 * after['decode_hot_share']:.1f}%)")
    if res.calibration:
        print("the calibration was carried over from the old plan (`ostinato calibrate` measures it again)")
    return 0


def _plan_split(a, cfg, counts, prof, names: list[str], formats):
    """Several GPUs: contiguous layer ranges balanced by memory (engine/assign.py), a capacity
    test per device with --gpu-memory as each device's cap, then each device's slots filled
    from its own layers. -> (hot, devices, budget per device, capacity, max_flex: the smallest
    device's bound on the flex slots, which every device's pools then keep)."""
    from ostinato.config import parse_bytes
    from ostinato.engine.assign import assign_devices
    from ostinato.engine.runner import RunnerSettings
    from ostinato.planner.capacity import device_capacity, fmt_bytes
    from ostinato.planner.fill import fill_per_device

    dtype = RunnerSettings(device=names[0], dtype=a.dtype).torch_dtype(cfg.torch_dtype)
    kv_tokens = a.max_context or (prof.max_tokens if prof else 0)
    budget = parse_bytes(a.gpu_memory) if a.gpu_memory else None
    devices = assign_devices(cfg, names, kv_tokens, dtype, caps=[budget] * len(names) if budget else None,
                             formats=formats)
    moe = {d: [l for l in layers if cfg.is_moe_layer(l)] for d, layers in devices.items()}
    slots, caps = {}, {}
    settings = _capacity_settings(a)
    bounds = [settings.max_flex]
    for i, (d, layers) in enumerate(devices.items()):
        want = round(a.hot_fraction * len(moe[d]) * cfg.num_experts) if a.hot_fraction is not None else None
        if budget is None:
            slots[d] = want
            print(f"{d}: layers {layers[0]}-{layers[-1]}, {want} hot experts")
            continue
        cap = device_capacity(cfg, counts, budget, kv_tokens, dtype, layers, i == 0, i == len(devices) - 1,
                              settings, want, name=d, formats=formats)
        caps[d], slots[d] = cap.to_json(), cap.hot_slots
        bounds.append(cap.max_flex)
        print(f"{d}: layers {layers[0]}-{layers[-1]}; capacity test, --gpu-memory {fmt_bytes(budget)} per device "
              f"({cap.dtype}; holds {cap.max_hot_slots} hot experts):")
        for what, n in cap.table():
            print(f"  {what:<44} {fmt_bytes(n):>11}")
    hot = fill_per_device(counts, moe, slots)
    capacity = {"kv_tokens": kv_tokens, "devices": caps} if budget else {}
    known = [b for b in bounds if b is not None]
    return hot, devices, budget, capacity, min(known) if known else None


def cmd_calibrate(a) -> int:
    import dataclasses

    from ostinato.engine.residency import Residency
    from ostinato.engine.routes import RouteCounts
    from ostinato.load import load_engine
    from ostinato.planner.calibrate import CalibrateSettings, calibrate, model_checks

    if not a.residency:
        raise ValueError("give --residency (a plan from `ostinato plan`)")
    res = Residency.load(a.residency).frequency_plan()  # measured by routes with its upload path, then decided again
    place = dataclasses.replace(placement_settings(a), cpu_backend=a.cpu_backend)  # the plan's cap: load_engine
    kv = a.max_context or res.capacity.get("kv_tokens") or None
    settings = dataclasses.replace(runner_settings(a), max_context=kv)
    loaded = load_engine(a.model, settings, place, residency=res)
    sizes = tuple(int(x) for x in a.sizes.split(",")) if a.sizes else CalibrateSettings.sizes
    cs = CalibrateSettings(reps=a.reps, sizes=sizes, pass_layers=a.pass_layers, sessions=a.sessions or "embedded:4")
    cal = calibrate(loaded, cs)
    prof_path = a.profile or (res.profile or {}).get("path")
    prof = None
    if prof_path:
        try:
            prof = RouteCounts.load(prof_path)
        except FileNotFoundError:
            print(f"note: profile {prof_path} not found; no model predictions, the upload path kept")
    res.calibration = cal
    if prof is not None:
        res = _decide_upload_path(res, cal, prof, prof.total("all"), loaded.source, loaded.runner.dtype,
                                  loaded.runner.settings.prefill_chunk, place.experts, place.borrow)
        res.calibration["model"] = {"profile": prof_path, **model_checks(res.calibration, prof, res.hot,
                                                                         loaded.runner.config)}
    out = a.output or a.residency
    res.save(out)
    print_calibration(res.calibration)
    print(f"calibration -> {out}")
    return 0


def _decide_upload_path(res, cal: dict, prof, counts, source, dtype, prefill_chunk: int, experts: str,
                        borrow: bool = False):
    """planner/pipeline.py plan_upload_path for a plan of this source with its experts kept as
    `experts` says (native or bf16), said in two lines."""
    from ostinato.engine.sizes import expert_sizes
    from ostinato.loader.build import expert_formats
    from ostinato.planner.pipeline import fill_text, plan_upload_path, upload_path_text

    cfg = source.config
    sizes = expert_sizes(cfg, dtype, expert_formats(source, experts))
    res = plan_upload_path(res, cal, prof, counts, sizes, cfg.num_experts_per_tok, prefill_chunk, borrow=borrow)
    print(f"fill {fill_text(res.calibration.get('fill'))}")
    print(f"upload path {upload_path_text(res.calibration['upload_path'])}; {res.hot_count} experts resident")
    return res


def print_calibration(cal: dict) -> None:
    g = cal["global"]
    layers = list(cal["layers"].values())
    if not any(d["cold"] for d in layers):
        print("note: this residency keeps every expert hot, so C(r), alpha, beta and Np were not measured; "
              "calibrate with a residency that leaves experts cold")
    Gs = sorted(d["G_ms"] for d in layers)
    print(f"calibrated on {cal['device']}, {cal['cpu_threads']} CPU threads ({cal['cpu_backend']}), "
          f"{cal['dtype']}, torch {cal['torch']}, in {cal['seconds']} s")
    t = cal.get("threads")
    if t:
        print(f"  threads: host on CPU {t['host']}, graph pollers on {t['pollers'] or 'none'}, {t['num_workers']} CPU "
              f"expert workers on {t['cpu_workers']} ({t['physical_cores']} physical cores)")
    print(f"  decode, per MoE layer: G {Gs[0]:.3f} / {Gs[len(Gs) // 2]:.3f} / {Gs[-1]:.3f} ms (min / median / max); "
          f"C(r): gamma0 {g['gamma0_ms']:.3f} ms, alpha {g['alpha_ms']:.3f} ms + beta {g['beta_ms']:.3f} ms per route")
    if cal.get("graph_fit"):
        f = cal["graph_fit"]
        gg = f" (G {g['G_graph_ms']:.3f} ms inside a graph)" if "G_graph_ms" in g else ""
        print(f"  decode steps replayed as CUDA graphs{gg}: the CPU branch through the worker alpha "
              f"{f['alpha_ms']:.3f} ms + beta {f['beta_ms']:.3f} ms per route (used by the model instead of the "
              "host-side fit)")
    print(f"  dense part of a decode step {cal['dense_step_ms']:.2f} ms (+{cal['dense_ms_per_1k_context']:.3f} ms "
          f"per 1k tokens of context); upload {cal['upload_gbps']:.1f} GB/s")
    fs = cal["forced_steps"]
    print("  decode steps forced to r cold routes per layer, measured / model ms: " + ", ".join(
        f"r={r}: {m:.2f} / {p:.2f}" for r, m, p in zip(fs["r"], fs["measured_ms"], fs["model_ms"])))
    p = cal.get("passes") or {}
    m = cal.get("model") or {}
    if p:
        mixed, paired = p.get("mixed_ms"), p.get("split_paired_ms")
        print("  n-token pass, per layer (ms):     n    split   upload  cheaper" +
              ("   model split  model upload" if "split_ms" in m else "") + ("  split+upload" if mixed else "") +
              (f"  paired split  layers won (of {p.get('paired_layers')})" if paired else ""))
        for i, n in enumerate(p["sizes"]):
            extra = f"   {m['split_ms'][i]:10.3f}  {m['upload_ms'][i]:12.3f}" if "split_ms" in m else ""
            extra += f"  {mixed[i]:12.3f}" if mixed else ""
            extra += f"  {paired[i]:12.3f}  {p['mixed_wins'][i]:>10d}" if paired else ""
            print(f"  {'':32}{n:5d} {p['split_ms'][i]:8.3f} {p['upload_ms'][i]:8.3f}  "
                  f"{'upload' if p['upload_ms'][i] < p['split_ms'][i] else 'split':>7}{extra}")
    if p.get("cpu_alone_ms"):
        print("  the split passes' CPU branch, host part / alone (nothing else running), per layer (ms): " + ", ".join(
            f"n={n}: {c:.2f} / {a:.2f}" for n, c, a in zip(p["sizes"], p["cpu_ms"], p["cpu_alone_ms"])))
    note = f" ({p.get('crossings')} crossings: the last one)" if p.get("crossings", 0) > 1 else ""
    print(f"  Np (upload_threshold) measured: {cal['upload_threshold']}{note}"
          + (f"; model: {m.get('upload_threshold')} (on the measured sizes {m.get('upload_threshold_on_sizes')})"
             if "upload_threshold" in m else ""))
    if m:
        bound = f"; bound {m['decode_bound_ms']:.2f} ms" if m.get("decode_bound_ms") else ""
        print(f"  predicted decode step {m['decode_step_ms']:.2f} ms ({m['decode_moe_ms']:.2f} ms in MoE layers, "
              f"{m['cold_routes_per_token_layer']:.2f} cold routes per token and layer; profile {m['profile']}){bound}")


def add_planner_commands(sub) -> None:
    p = sub.add_parser("plan", help="choose the resident experts: capacity test under a GPU memory cap, then fill")
    p.add_argument("--model", required=True)
    p.add_argument("--profile", help="development profile from `ostinato profile`")
    p.add_argument("--sessions", help="profile these development sessions now (instead of --profile)")
    p.add_argument("--held-out", help="held-out profile, to report the hot share it gets")
    p.add_argument("--from-served", metavar="RESIDENCY", help="plan again from the routes served with this "
                   "residency (kept beside it by `ostinato serve`), for the same cap and context")
    p.add_argument("--gpu-memory", help="GPU memory cap, e.g. 32GiB: the pool gets what the capacity test leaves")
    p.add_argument("--hot-fraction", type=float, help="pool size as a share of all experts (checked against "
                   "--gpu-memory when both are given)")
    p.add_argument("--max-context", type=int, help="KV cache tokens to plan for (default: the profile's longest "
                   "request)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="the runner's largest forward pass")
    add_margin_args(p)
    p.add_argument("--attention-scores", type=float, help="count the prefill's attention as torch's math kernel "
                   "holding this share of a pass's scores at once (default: the model's: SDPA's fused kernels, no "
                   "scores, where its prefill takes them on the GPU, Qwen3's; else the math kernel with all of them)")
    p.add_argument("--max-flex", type=int, help="at most this many flex slots (the upload path's staging) per "
                   "expert format group; a pass with more cold experts uploads the most routed and computes the "
                   "rest on the CPU (default: --flex-share of the pool)")
    p.add_argument("--flex-share", type=float, default=0.25, help="without --max-flex: the flex slots take at "
                   "most this share of the pool's bytes (default 0.25)")
    p.add_argument("--device", help="the GPU (default: cuda if present)")
    p.add_argument("--devices", help="comma-separated GPUs of this host, e.g. cuda:0,cuda:1: layers split "
                   "across them, one pool each; --gpu-memory is then per device")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="compute dtype (default: the engine's)")
    p.add_argument("--cpu-threads", type=int, help="CPU expert threads for the verification run")
    p.add_argument("--no-verify", action="store_true", help="skip running the longest request under the cap")
    p.add_argument("--experts", choices=["native", "bf16"], default="native", help="plan for a GGUF file's experts "
                   "(and attention and head) in their block formats (native, what serve keeps by default) or "
                   "dequantized to bf16")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("calibrate", help="measure the cost model's constants and Np in the engine; "
                       "stored in the residency file")
    add_model_args(p)
    p.add_argument("--profile", help="profile for the model's predictions (default: the plan's)")
    p.add_argument("--sessions", help="prompts whose routing the n-token passes use (default embedded:4)")
    p.add_argument("--sizes", help="pass sizes, comma-separated (default: calibrate.DEFAULT_SIZES, 64 to 2048)")
    p.add_argument("--pass-layers", type=int, default=4, help="layers whose passes are timed")
    p.add_argument("--reps", type=int, default=15, help="one-token measurements per layer and r")
    p.add_argument("--cpu-backend", choices=["auto", "native", "torch"], default="auto")
    p.add_argument("-o", "--output", help="write here (default: update --residency in place)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("profile", help="count routes per (layer, expert) over development sessions")
    add_model_args(p)
    p.add_argument("--sessions", help="sessions (file, folder, or 'embedded'; default embedded)")
    p.add_argument("--max-sessions", type=int)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("skew", help="measure: share of held-out routes on the top experts of dev sessions")
    add_model_args(p)
    p.add_argument("--sessions", help="sessions to split into dev / held-out (default embedded)")
    p.add_argument("--max-sessions", type=int, help="at most this many sessions per side")
    p.add_argument("--fraction", type=float, nargs="+", default=[0.40, 0.44])
    p.add_argument("--save-profiles", metavar="PREFIX", help="also write PREFIX-dev.json and PREFIX-held-out.json")
    p.set_defaults(func=cmd_skew)
