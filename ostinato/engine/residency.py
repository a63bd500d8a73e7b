"""The residency set: which experts of which layer live in a GPU's expert pool.

A residency file is written once by `ostinato plan` and read at every start. It is
JSON a person can read and edit (hot experts per layer), carries the fingerprint of the
model it was planned for (config shapes and router weights: the routers decide where
tokens go, so a plan made for other routers is worthless), the memory budget, the
profile it came from, and the calibrated cost-model constants once `calibrate` ran,
with the planner's decision on the upload path that the calibration informed (a plan
without it keeps no flex slots and no Np: `upload_path`, `upload_plan`).
`max_flex` is the bound on each format group's flex slots that the capacity test counted
(planner/capacity.py); the engine allocates no more (a file without it: unbounded, as before).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ostinato.config import ConfigError, ModelConfig
from ostinato.engine.assign import layer_map

FORMAT = "ostinato.residency"
VERSION = 1


# routing settings beyond softmax top-k: hashed where they differ from ModelConfig's defaults, so
# a Qwen3 model's fingerprint stays what it was before the other families came
ROUTING_KEYS = ("scoring_func", "n_group", "topk_group", "routed_scaling_factor")


DECISIONS = ("upload_path", "fill")  # what the planner decided on the plan a calibration measured (planner/pipeline.py)


def measured(calibration: dict) -> dict:
    """A calibration's measurements without the planner's decisions on the plan it measured: what
    another plan of the same machine and model may take (its decisions are made again for it)."""
    return {k: v for k, v in calibration.items() if k not in DECISIONS}


def model_fingerprint(source) -> str:
    """sha256 over the architecture's shapes, the routing settings and every router's weights
    (checkpoint dtype), its selection bias too where it has one."""
    cfg: ModelConfig = source.config
    h = hashlib.sha256()
    keys = ("hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
            "norm_topk_prob", "vocab_size")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    shapes = {k: getattr(cfg, k) for k in keys}
    shapes |= {k: getattr(cfg, k) for k in ROUTING_KEYS if getattr(cfg, k) != defaults[k]}
    h.update(json.dumps(shapes, sort_keys=True).encode())
    names = set(source.names())
    for layer in cfg.moe_layers:
        router = f"model.layers.{layer}.mlp.gate."
        if router + "weight" not in names:
            router = f"model.layers.{layer}.mlp.router."  # gpt-oss's, a linear with a bias
        bias = [router + b for b in ("e_score_correction_bias", "bias") if router + b in names]
        for name in [router + "weight", *bias]:
            t = torch.empty(source.shape(name), dtype=cfg.torch_dtype)
            source.load_(name, t)
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


@dataclass
class Residency:
    fingerprint: str
    num_experts: int
    hot: dict[int, list[int]]  # layer -> sorted expert ids resident on the GPU
    devices: dict[str, list[int]] = field(default_factory=dict)  # device -> its layers
    gpu_memory: int | None = None  # the budget the plan was made for (bytes), per device
    profile: dict = field(default_factory=dict)  # where the counts came from
    calibration: dict = field(default_factory=dict)  # cost-model constants, Np (from calibrate)
    notes: dict = field(default_factory=dict)
    capacity: dict = field(default_factory=dict)  # the capacity test's breakdown (bytes), verification
    max_flex: int | None = None  # each format group's flex slots at most (None: its most cold experts of a layer)

    @property
    def hot_count(self) -> int:
        return sum(len(v) for v in self.hot.values())

    @property
    def upload_path(self) -> bool:
        """Whether this plan has the upload path (flex slots, Np, the split with uploads). The
        planner drops it where its calibration predicts that the upload path and the split with
        uploads save less over the development sessions than the flex slots' bytes would as hot
        experts (planner/pipeline.py plan_upload_path); the decision, with its numbers, is
        calibration["upload_path"]. A plan without a decision has it."""
        return bool((self.calibration.get("upload_path") or {}).get("on", True))

    def upload_plan(self) -> "Residency":
        """The plan with the upload path this one was made from: itself if it has one, else its
        hot experts less those the flex slots' bytes went to (calibration.upload_path.added), with
        the capacity it had. What needs the flex slots runs it: --borrow, an --upload-threshold
        given, the ktransformers baseline, Ostinato's ablation steps, a new calibration."""
        up = self.calibration.get("upload_path") or {}
        if up.get("on", True):
            return self
        added = {int(l): set(v) for l, v in (up.get("added") or {}).items()}
        hot = {l: [e for e in v if e not in added.get(l, ())] for l, v in self.hot.items()}
        return dataclasses.replace(self, hot=hot, calibration={k: v for k, v in self.calibration.items()
                                                               if k != "upload_path"},
                                   capacity={**self.capacity, **(up.get("capacity") or {})})

    def frequency_plan(self) -> "Residency":
        """The plan filled by route counts (planner/fill.py) with the upload path that this one was
        made from: its upload plan, less the experts the fill by time saved brought in and with those
        it took out (calibration.fill, planner/pipeline.py refill_by_time). KTransformers' frequency
        strategy ranks by routes and runs it (the ktransformers baseline); a new decision starts
        from it."""
        plan = self.upload_plan()
        f = plan.calibration.get("fill") or {}
        if not f:
            return plan
        moved_in = {int(l): set(v) for l, v in (f.get("in") or {}).items()}
        moved_out = {int(l): set(v) for l, v in (f.get("out") or {}).items()}
        hot = {l: sorted((set(v) - moved_in.get(l, set())) | moved_out.get(l, set())) for l, v in plan.hot.items()}
        return dataclasses.replace(plan, hot=hot, calibration={k: v for k, v in plan.calibration.items() if k != "fill"})

    def is_hot(self, layer: int) -> torch.Tensor:
        m = torch.zeros(self.num_experts, dtype=torch.bool)
        m[self.hot.get(layer, [])] = True
        return m

    def layer_devices(self, num_layers: int) -> list[str] | None:
        """Each decoder layer's device under `devices` (a layer not listed goes with the one
        before it, leading ones with the first device); None for a plan of one device."""
        return layer_map(self.devices, num_layers) if len(self.devices) > 1 else None

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
                "num_experts": self.num_experts, "gpu_memory": self.gpu_memory, "devices": self.devices,
                "hot_experts": self.hot_count, "profile": self.profile, "calibration": self.calibration,
                "capacity": self.capacity, "max_flex": self.max_flex, "notes": self.notes,
                "hot": {str(l): sorted(v) for l, v in sorted(self.hot.items())}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Residency":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such residency file (make one with `ostinato plan`)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not a residency file ({e})") from None
        if d.get("format") != FORMAT:
            raise ConfigError(f"{path}: not a residency file (format {d.get('format')!r})")
        if d.get("version") != VERSION:
            raise ConfigError(f"{path}: residency version {d.get('version')} is not supported (want {VERSION}); "
                              "plan again with this version of ostinato")
        return cls(d["fingerprint"], d["num_experts"], {int(l): list(v) for l, v in d["hot"].items()},
                   d.get("devices") or {}, d.get("gpu_memory"), d.get("profile") or {},
                   d.get("calibration") or {}, d.get("notes") or {}, d.get("capacity") or {}, d.get("max_flex"))

    def check(self, source, fingerprint: str | None = None) -> None:
        """Fail with a clear message if this plan was made for another model."""
        cfg = source.config
        fp = fingerprint or model_fingerprint(source)
        if fp != self.fingerprint:
            raise ConfigError("the residency file was planned for another model (fingerprint "
                              f"{self.fingerprint[:19]}..., this model {fp[:19]}...): run `ostinato plan` for it")
        bad = [l for l in self.hot if l not in cfg.moe_layers]
        if bad or any(e < 0 or e >= cfg.num_experts for v in self.hot.values() for e in v):
            raise ConfigError("the residency file names layers or experts this model does not have")
        if self.max_flex is not None and (not isinstance(self.max_flex, int) or self.max_flex < 0):
            raise ConfigError(f"the residency file's max_flex must be a number of slots (>= 0), not {self.max_flex!r}")
        listed = [l for v in self.devices.values() for l in v]
        if len(listed) != len(set(listed)) or any(l < 0 or l >= cfg.num_hidden_layers for l in listed):
            raise ConfigError("the residency file's `devices` must give each layer of this model to one device")


def residency_from_mask(fingerprint: str, masks: dict[int, torch.Tensor], **kw) -> Residency:
    num_experts = next(iter(masks.values())).numel()
    return Residency(fingerprint, num_experts, {l: m.nonzero().flatten().tolist() for l, m in masks.items()}, **kw)
