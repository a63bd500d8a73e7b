"""The pictures a reader would rather look at than read (BENCHMARK.md): TTFT distribution
per engine (CDF), prefill and decode time per engine, median TTFT against new tokens (the
length sweep), and decode step against resident experts. matplotlib, Agg backend, PNG."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    _plt().close(fig)
    return name


def write_plots(result: dict, turns: dict[str, list[dict]], out: Path) -> list[str]:
    """Writes the PNGs into out; returns their file names."""
    plt = _plt()
    names = [n for n, e in result["policies"].items() if "summary" in e]
    if not names:
        return []
    files = []

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n in names:
        xs = sorted(1000 * t["ttft_s"] for t in turns.get(n, []) if t["kind"] != "sweep" and t["ttft_s"] is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=n)
    ax.set(xscale="log", xlabel="TTFT (ms, log scale)", ylabel="share of held-out turns", title="TTFT distribution")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(_save(fig, out, "ttft_cdf.png"))

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    summ = {n: result["policies"][n]["summary"] for n in names}
    panels = ((axes[0], "prefill_ms", "median prefill (ms)"), (axes[1], "decode_step_ms", "median decode step (ms)"))
    for ax, key, title in panels:
        vals = [summ[n][key]["median"] or 0 for n in names]
        ax.bar(range(len(names)), vals, color="tab:blue" if key == "prefill_ms" else "tab:orange")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    files.append(_save(fig, out, "prefill_decode.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4))
    drawn = False
    for n in names:
        pts = (result["policies"][n].get("sweep") or {}).get("points", [])
        pts = [p for p in pts if p["ttft_ms"] is not None]
        if pts:
            ax.plot([p["new_tokens"] if p["new_tokens"] is not None else p["size"] for p in pts],
                    [p["ttft_ms"] for p in pts], marker="o", label=n)
            drawn = True
    if drawn:
        np_ = (result.get("np") or {}).get("value")
        if np_:
            ax.axvline(np_, color="grey", ls=":", lw=1, label=f"Np = {np_}")
        ax.set(xlabel="new prompt tokens", ylabel="median TTFT (ms)", title="TTFT against new tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        files.append(_save(fig, out, "ttft_vs_new_tokens.png"))
    else:
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n in names:
        e = result["policies"][n]
        y = summ[n]["decode_step_ms"]["median"]
        if y is not None:
            ax.scatter([e.get("resident_experts", 0)], [y], s=40)
            ax.annotate(n, (e.get("resident_experts", 0), y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.axvline(result["budget"]["pool_slots"], color="grey", ls=":", lw=1, label="budget (pool slots)")
    ax.set(xlabel="experts resident or cached on the GPU", ylabel="median decode step (ms)",
           title="Decode step against resident experts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(_save(fig, out, "decode_vs_resident.png"))
    return files
