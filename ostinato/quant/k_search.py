"""Scale searches of the K-quants, after ggml's reference quantizers (ggml-quants.c).

Rounding to the grid that spans a sub-block's range exactly is rarely the least-squares
best: a slightly finer or coarser grid, refitted, often has a smaller error. Both searches
here try a fixed ladder of candidate inverse scales, refit the scale (and min) by weighted
least squares to each candidate's codes, and keep the best; the ladder and the weights are
ggml's, so the choices match llama.cpp's in all but float-summation-order ties.

- `fit_scale_min` (ggml's make_qkx2_quants, Q4_K/Q5_K): w ~ scale * l - min, l in [0, nmax].
- `fit_scale` (ggml's make_qx_quants with weights x^2, Q6_K): w ~ scale * l,
  l in [-nmax, nmax - 1]; the scale's sign puts the largest magnitude at -nmax.

Every candidate is one vectorised pass over all sub-blocks, so the Python loop runs over
the ladder (about 20 steps), never over blocks.

Legend: S sub-blocks, V values in a sub-block (32 or 16).
"""
from __future__ import annotations

import torch

from ostinato.quant.bits import div

# ggml's GROUP_MAX_EPS: a sub-block whose largest magnitude is below it is all zero.
GROUP_MAX_EPS = 1e-15


def fit_scale_min(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, w float32 [S, V] -> (scale [S], min [S]), min >= 0, x ~ scale * l - min.

    Candidate i rounds (x - low) * (nmax + rmin + rdelta * i) / (max - low), with low the
    best offset found so far (ggml moves the grid's origin with its best fit, so later
    candidates start from the refitted min; doing the same keeps our choices ggml's)."""
    hi = x.amax(dim=1, keepdim=True)
    lo = x.amin(dim=1, keepdim=True).clamp(max=0)
    flat = hi == lo
    sum_w = w.sum(dim=1, keepdim=True)
    wx = w * x
    sum_x = wx.sum(dim=1, keepdim=True)
    sum_x2 = (wx * x).sum(dim=1, keepdim=True)

    def moments(iscale, low):
        # sum w l, sum w l^2, sum w x l over the codes l of one candidate (in place: this
        # pass over the values is the cost of the whole search).
        lq = (x - low).mul_(iscale).round_().clamp_(0, nmax)
        wl = w * lq
        sum_l = wl.sum(dim=1, keepdim=True)
        sum_l2 = wl.mul_(lq).sum(dim=1, keepdim=True)
        return sum_l, sum_l2, lq.mul_(wx).sum(dim=1, keepdim=True)

    def error(scale, low, sum_l, sum_l2, sum_xl):
        # sum w (scale * l + low - x)^2, expanded into the moments: no extra pass over values.
        return (
            scale * scale * sum_l2 + low * low * sum_w + sum_x2
            + 2 * (scale * low * sum_l - scale * sum_xl - low * sum_x)
        )

    def span(low):
        s = hi - low
        return torch.where(s > 0, s, torch.ones_like(s))  # flat sub-blocks: any grid

    best_scale, best_low = div(span(lo), nmax), lo
    best_err = error(best_scale, best_low, *moments(nmax / span(lo), lo))
    for i in range(nstep + 1):
        sum_l, sum_l2, sum_xl = moments((rmin + rdelta * i + nmax) / span(best_low), best_low)
        det = sum_w * sum_l2 - sum_l * sum_l
        scale = (sum_w * sum_xl - sum_x * sum_l) / det
        low = (sum_l2 * sum_x - sum_l * sum_xl) / det
        # A positive fitted min would mean an offset above zero: pin it to zero instead.
        pinned = low > 0
        scale = torch.where(pinned, sum_xl / sum_l2, scale)
        low = torch.where(pinned, torch.zeros_like(low), low)
        err = error(scale, low, sum_l, sum_l2, sum_xl)
        better = (det > 0) & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_low = torch.where(better, low, best_low)
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    return best_scale.squeeze(1), -best_low.squeeze(1)


def fit_scale(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """x float32 [S, V] -> signed scale [S], x ~ scale * l with weights x^2. Candidates:
    inverse scales -(nmax + 0.1 * i) / m for i in -9..9, m the value of largest magnitude."""
    m = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
    zero = m.abs() < GROUP_MAX_EPS
    m = torch.where(zero, torch.ones_like(m), m)
    w = x * x
    wx = w * x

    def sums(iscale):
        lq = (iscale * x).round_().clamp_(-nmax, nmax - 1)
        sum_lx = (wx * lq).sum(dim=1, keepdim=True)
        return sum_lx, lq.square_().mul_(w).sum(dim=1, keepdim=True)

    sum_lx, sum_l2 = sums(-nmax / m)
    scale = torch.where(sum_l2 > 0, sum_lx / sum_l2, torch.zeros_like(sum_l2))
    best = scale * sum_lx
    for i in range(-9, 10):
        if i == 0:
            continue
        sum_lx, sum_l2 = sums(-(nmax + 0.1 * i) / m)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = torch.where(better, sum_lx / sum_l2, scale)
        best = torch.where(better, scale * sum_lx, best)
    return torch.where(zero, torch.zeros_like(scale), scale).squeeze(1)
