"""What every model family shares: the pass the runner drives, and the pieces of a decoder.

A family's model (models/qwen3_moe.py, models/deepseek_v3.py) is a `MoECausalLM`: the
runner embeds, runs decoder layers in ranges (one per device) and takes the logits, the
same way for every family; the routed experts are a backend plugged into each MoE block
(`set_experts`). A family declares what the engine allocates around it: its KV cache per
token and layer (`kv_shapes`: the cache stores whatever the attention needs, per-head K/V
or a compressed latent), the attention buffers a prefill holds (`attention_shape`, for the
planner's capacity test) and the parameters that stay fp32 in a bf16 model (`fp32_params`).

Legend: T new tokens, D hidden, Hd rotary dim, V vocabulary.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from ostinato.config import ModelConfig
from ostinato.kernels.triton import fused_dense
from ostinato.layers.moe.types import TopKOutput
from ostinato.layers.quant_linear import QuantLinear, quant_linear

KVShapes = dict[str, tuple[int, ...]]  # one layer's cache tensors: name -> per-token shape


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Prefill attention of T new tokens after L - T cached ones, per head: q [H, T, Dk], k [Hkv, L, Dk],
    v [Hkv, L, Dv] with Hkv dividing H (grouped-query attention: query head h reads K/V head
    h // (H / Hkv)) -> [H, T, Dv]; query i sees keys [0, L - T + i]. Four-dimensional inputs and a
    causal flag (T = L) or the lower-right causal bias, never an explicit mask, so that SDPA may take
    a fused kernel (flash, memory-efficient or cuDNN) that holds no H x T x L score matrix: with
    three-dimensional inputs torch does not consider the memory-efficient kernel, and an explicit
    [T, L] mask forces the math kernel (about 13 GiB of fp32 scores at 2048 x 16k tokens).
    Grouped K/V heads go in as they are (SDPA's enable_gqa) where the fused kernels take them
    (fused_attention_available(..., gqa=True)); elsewhere they are repeated first, which copies the
    whole window each layer (H / Hkv times K and V: 67 MB of each for Qwen3-30B-A3B at 8k tokens;
    session 23's profile of a 235B-shaped prefill spent 52 us a layer and copy on them)."""
    rep = q.shape[0] // k.shape[0]
    gqa = rep > 1 and fused_attention_available(q.shape[-1], v.shape[-1], q.dtype, q.device.type, gqa=True)
    if rep > 1 and not gqa:
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    return _sdpa(q, k, v, scale, gqa)


def _sdpa(q, k, v, scale, gqa: bool) -> torch.Tensor:
    T, L = q.shape[1], k.shape[1]
    mask = {"is_causal": True} if T == L else {"attn_mask": causal_lower_right(T, L)}
    return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, enable_gqa=gqa, **mask)[0]


FUSED_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


@functools.lru_cache(maxsize=None)
def fused_attention_available(qk_dim: int, v_dim: int, dtype: torch.dtype, device: str, gqa: bool = False) -> bool:
    """Whether SDPA's fused kernels (FUSED_BACKENDS: no score matrix) take `causal_attention` with
    these head dims and dtype on `device`, both with the causal flag and with the lower-right bias
    (gqa: with two query heads on one K/V head, as enable_gqa passes them): tried once per process
    on small inputs laid out as the models lay them out (kernel support depends on the head dims,
    dtype and device, not on the number of heads or tokens)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(16, 2, qk_dim, generator=g, device=device, dtype=dtype).transpose(0, 1) for _ in "qk")
    v = torch.randn(16, 2, v_dim, generator=g, device=device, dtype=dtype).transpose(0, 1)
    if gqa:
        k, v = k[:1], v[:1]
    try:
        with sdpa_kernel([getattr(SDPBackend, b) for b in FUSED_BACKENDS]):
            _sdpa(q, k, v, None, gqa)
            _sdpa(q[:, 8:], k, v, None, gqa)
        return True
    except RuntimeError:
        return False


class AttentionShape(NamedTuple):
    """The attention of one layer as a prefill computes it (planner/capacity.py bounds its
    buffers with this): heads of queries and of keys/values as the kernel reads them, their
    head dims, the rotary dims, and the elements per cached token that a prefill builds from
    the cache before attending (MLA: the up-projected keys and values and the assembled keys;
    0 where the cache holds K/V themselves), the most attention scores a pass holds at once
    where the model computes its attention in chunks of queries (0: the whole H x T x N), and
    whether a pass attends through `causal_attention` (a causal flag or the lower-right causal
    bias, no explicit mask), which on a GPU in half precision SDPA's fused kernels run without a
    score matrix where they take the head dims (fused_attention_available, asked on the GPU); and
    for MLA the latent width R a captured pass attends in (0: the heads above; split_k_heads)."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    rope_dim: int
    expanded_per_token: int = 0
    max_scores: int = 0
    fused_on_gpu: bool = False
    latent_dim: int = 0

    def split_k_heads(self) -> tuple[int, int, int]:
        """(Hkv, G, Dv) as a captured pass's split-K kernel (kernels/triton/decode_attention.py)
        attends: MLA's latent cache is one KV head whose H query rows read R values; otherwise
        the heads above."""
        if self.latent_dim:
            return 1, self.heads, self.latent_dim
        return self.kv_heads, self.heads // self.kv_heads, self.v_dim


class ExpertsBackend(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """x [T, D], topk ids/weights [T, K] -> routing-weighted sum of experts [T, D]."""

    def many(self, layer: int, xs: list[torch.Tensor], topks: list[TopKOutput]) -> list[torch.Tensor]:
        """The chunks of one pass through a layer at once (RoutedBlock.forward_chunks) -> each chunk's
        sum, as __call__ gives it (layers/moe/backend.py MoEBackend.many)."""


class RMSNorm(nn.Module):
    """fp32 statistics; the result cast back before the weight multiplies it (Qwen3, DeepSeek), or with
    `fp32_weight` the weight applied in fp32 and the product cast back (gpt-oss): as each reference does."""

    def __init__(self, dim: int, eps: float, fp32_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.fp32_weight = eps, fp32_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (self.fp32_weight or self.weight.dtype == x.dtype) and fused_dense():
            from ostinato.kernels.triton.rms_norm import rms_norm  # the same arithmetic in one launch, not eight

            return rms_norm(x, self.weight, self.eps, self.fp32_weight)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, its norm): on CUDA in the norm's launch (kernels/triton/rms_norm.py residual)."""
        if x.is_cuda and y.dtype == x.dtype and (self.fp32_weight or self.weight.dtype == x.dtype) and fused_dense():
            from ostinato.kernels.triton.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, self.fp32_weight, residual=y)
        s = x + y
        return s, self(s)


class FusedProjections:
    """Linears of one input as one matmul ([Q]: Qwen3's q, k and v projections were three GEMMs a
    layer in the decode step). Their weights (and biases) are concatenated into one tensor and the
    modules' parameters re-pointed at its row ranges, so the checkpoint's names, the state dict and
    every byte count still see three parameters, and no second copy exists. Made after the model's
    last move (the runner's placement): a later .to() would move the views apart from it. Weights
    kept in GGUF blocks (QuantLinear) concatenate the same way, rows being whole blocks, where all
    share one format (`of` says whether the linears can fuse)."""

    def __init__(self, *linears: nn.Module):
        quant = isinstance(linears[0], QuantLinear)
        self.qtype, self.n = (linears[0].qtype, linears[0].in_features) if quant else (None, None)
        name = "qweight" if quant else "weight"
        self.weight = torch.cat([getattr(m, name) for m in linears])
        has_bias = linears[0].bias is not None
        self.bias = torch.cat([m.bias for m in linears]) if has_bias else None
        self.sizes, at = [getattr(m, name).shape[0] for m in linears], 0
        for m, n in zip(linears, self.sizes):
            if quant:
                m.qweight = self.weight[at:at + n]  # a buffer: re-pointed as the weights are
            else:
                m.weight = nn.Parameter(self.weight[at:at + n], requires_grad=False)
            if has_bias:
                m.bias = nn.Parameter(self.bias[at:at + n], requires_grad=False)
            at += n

    @classmethod
    def of(cls, *linears: nn.Module) -> "FusedProjections | None":
        """The linears fused, or None where they cannot be: float and block weights mixed, blocks in
        different formats (a Q4_K_M file stores some layers' v in Q6_K, q and k in Q4_K), biases on
        some only."""
        kinds = {(type(m), getattr(m, "qtype", None), m.bias is not None) for m in linears}
        return cls(*linears) if len(kinds) == 1 else None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> each linear's output [T, N_i] (column ranges of one product)."""
        if self.qtype is not None:
            return quant_linear(x, self.weight, self.qtype, self.n, self.bias).split(self.sizes, dim=-1)
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


class DenseMLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RoutedBlock(nn.Module):
    """An MoE block: its router is a parameter of the model, its routed experts the backend
    the runner plugs in (`experts`). A family says how its block routes (`route`) and what it adds
    to the routed experts' sum (`finish`: shared experts); the block is the two around one call of
    the backend, or (`forward_chunks`) around one call for every chunk of a pass, so that a backend
    which stages experts does so once for all of them (engine/devices.py forward_layer_major)."""

    layer: int
    experts: ExpertsBackend | None = None

    def route(self, h: torch.Tensor) -> TopKOutput:
        """h [T, D], the MLP's input -> the routing, ids and weights [T, K]."""
        raise NotImplementedError

    def finish(self, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The block's output [T, D] from its input h and the routed experts' sum [T, D]: that sum,
        unless the family adds to it."""
        return routed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.finish(h, self.experts(self.layer, h, self.route(h)))

    def forward_chunks(self, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        """forward of each chunk of a pass (hs: their inputs [T_c, D]), the routed experts of all of them
        in one call of the backend (ExpertsBackend.many)."""
        routed = self.experts.many(self.layer, hs, [self.route(h) for h in hs])
        return [self.finish(h, routed.pop(0)) for h in hs]  # each sum let go once finished


class DecodeWindow:
    """A captured pass's position as a device tensor and the cache window it attends over: a decode
    step's one token, or the `tokens` rows of a short prefill pass (engine/graph.py PassGraphs) at
    position, position + 1, ... (token t attends cache rows 0..position + t).

    The mask over the window and the sliding bands are made by the first layer of a pass that asks for
    them and shared by the rest (inside a capture, recorded there once): attention that reads the cache
    in place (the split-K kernel) never asks."""

    def __init__(self, position: torch.Tensor, size: int, tokens: int = 1):
        self.position = position  # [1] int64, on the model's device: the first token's
        self.size, self.tokens = size, tokens
        self._cols = torch.arange(size, device=position.device)[None, :]
        self._rows = torch.arange(tokens, device=position.device)
        self.positions = position  # [tokens] int64: every token's, set by refresh
        self._mask: torch.Tensor | None = None
        self._bands: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def refresh(self) -> None:
        """A new pass: the positions from the device position (once per pass, inside any capture); the
        mask and bands of the last pass are dropped."""
        if self.tokens > 1:
            self.positions = self.position + self._rows
        self._mask, self._bands = None, {}

    @property
    def mask(self) -> torch.Tensor:
        """[tokens, W] bool: token t sees cache rows 0..position + t."""
        if self._mask is None:
            self._mask = self._cols <= self.positions[:, None]
        return self._mask

    def band(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding window of w rows: the w + tokens - 1 cache rows that end at the last token (rows
        before 0 clamped to 0) as an int64 index [span], and the mask [tokens, span] (one row at decode)
        of those that token t reads: rows t..t + w - 1, none before 0."""
        if w not in self._bands:
            T, dev = self.tokens, self.position.device
            span = w + T - 1
            rows = self.position - (w - 1) + torch.arange(span, device=dev)  # [span]
            mask = (rows >= 0)[None, :]
            if T > 1:
                band = torch.arange(span, device=dev)[None, :] - self._rows[:, None]
                mask = mask & (band >= 0) & (band < w)  # [T, span]
            self._bands[w] = rows.clamp(min=0), mask
        return self._bands[w]


class DecoderLayer(nn.Module):
    """Every family's layer: attention and MLP, each after its norm and added to the residual."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()

    def attend(self, x, cos, sin, kv, start: int, window=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention half: x [T, D] -> (the residual after attention, the MLP's input h), both [T, D]."""
        return self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), cos, sin, kv,
                                                                           start, window))

    def forward(self, x, cos, sin, kv, start: int, window=None) -> torch.Tensor:
        x, h = self.attend(x, cos, sin, kv, start, window)
        return x + self.mlp(h)

    def forward_chunks(self, chunks: list["PassChunk"], kv) -> None:
        """Every chunk of a pass through this layer, in order: chunk c attends over the cache rows that
        chunks 0..c wrote, as forward would one chunk after the other; each chunk's x becomes its output.
        A routed MLP takes the chunks together (RoutedBlock.forward_chunks) once all have attended: each
        chunk's input is dropped as its attention ends, its residual and MLP input wait for the others
        (planner/capacity.py activation_bytes, "chunk_states", counts them)."""
        if len(chunks) == 1 or not isinstance(self.mlp, RoutedBlock):
            for c in chunks:
                c.x = self(c.x, c.cos, c.sin, kv, c.start)
            return
        hs = []
        for c in chunks:
            c.x, h = self.attend(c.x, c.cos, c.sin, kv, c.start)
            hs.append(h)
        ys = self.mlp.forward_chunks(hs)
        del hs  # the MLP inputs go before the residual sums are made
        for c, y in zip(chunks, ys):
            c.x = c.x + y


@dataclass
class PassChunk:
    """One chunk of a pass run layer by layer (engine/devices.py forward_layer_major): its hidden states
    x [T, D] between layers, its rotary cos, sin [T, Hd] and its first position."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    start: int

    def to(self, device: torch.device) -> "PassChunk":
        return PassChunk(self.x.to(device), self.cos.to(device), self.sin.to(device), self.start)


class DecoderStack(nn.Module):
    """The checkpoint's `model.`: embed_tokens, the decoder layers, the final norm."""

    def __init__(self, cfg: ModelConfig, layer: Callable[[int], nn.Module], norm: Callable[[], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = norm()


class MoECausalLM(nn.Module):
    """The pass every family's model runs. A subclass builds `self.model` (embed_tokens,
    layers, norm), `self.lm_head` and `self.rotary`, and says what the engine allocates for it."""

    fp32_params: tuple[str, ...] = ()  # parameter name endings kept in fp32 whatever the compute dtype

    config: ModelConfig

    @staticmethod
    def kv_shapes(cfg: ModelConfig) -> KVShapes:
        """The cache tensors of one decoder layer (every layer has the same) and their shape per token."""
        raise NotImplementedError

    @staticmethod
    def attention_shape(cfg: ModelConfig) -> AttentionShape:
        raise NotImplementedError

    def build(self, cfg: ModelConfig, layer: Callable[[int], nn.Module], norm: Callable[[], nn.Module],
              rope_dim: int) -> None:
        """The parts every family has: `model` (DecoderStack of layer(i)), lm_head (tied to the
        embedding if the config says so) and the rotary table of `rope_dim` dims."""
        from ostinato.models.rope import RotaryEmbedding

        self.config = cfg
        self.model = DecoderStack(cfg, layer, norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg, rope_dim)

    def fuse_projections(self) -> None:
        """Each attention's q, k and v projections as one matmul (FusedProjections), where the
        family's attention offers it; the runner calls this once the model is where it runs."""
        for layer in self.model.layers:
            fuse = getattr(layer.self_attn, "fuse_qkv", None)
            if fuse is not None:
                fuse()

    def set_experts(self, backend: ExpertsBackend) -> None:
        for layer in self.model.layers:
            if isinstance(layer.mlp, RoutedBlock):
                layer.mlp.experts = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: list, start: int,
                window: DecodeWindow | None = None, rows: torch.Tensor | None = None):
        """input_ids, positions [T] -> final hidden states [T, D] (after the last norm); `rows`:
        the embedding's rows of input_ids [T, D] where the runner looked them up (host_embedding).

        With a DecodeWindow (a decode step's one token, or a short pass's tokens: every family's
        attention takes several), the position is read from the device only, so the pass can be
        captured once and replayed (see engine/graph.py). The pass is embed, then
        run_layers over every layer, then the norm: the runner may run the layers in ranges
        (one per device, engine/devices.py)."""
        x, cos, sin = self.embed(input_ids, positions, start, window, rows)
        x = self.run_layers(range(len(self.model.layers)), x, cos, sin, kv, start, window)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, start: int,
              window: DecodeWindow | None = None,
              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The start of a pass: x [T, D] (`rows`, else the embedding's rows of input_ids) and the
        rotary cos, sin [T, Hd] (the window's mask is refreshed here)."""
        x = self.model.embed_tokens(input_ids) if rows is None else rows
        if window is not None:
            window.refresh()
            positions = window.positions
        seq_len = window.size if window is not None else start + input_ids.shape[0]
        cos, sin = self.rotary(positions, seq_len, x.dtype)
        return x, cos, sin

    def run_layers(self, layers: range, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: list,
                   start: int, window: DecodeWindow | None = None) -> torch.Tensor:
        """Decoder layers `layers` (a range, in order) on x [T, D]."""
        for i in layers:
            x = self.model.layers[i](x, cos, sin, kv[i], start, window)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] in fp32."""
        return self.lm_head(hidden).float()
