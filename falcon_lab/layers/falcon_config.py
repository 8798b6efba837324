"""The Falcon mixer's knobs in one place: `FalconConfig`, a dataclass that is

- the schema of `configs/mixer/falcon.yaml` (registered in Hydra's ConfigStore as `mixer/falcon_schema`
  by `falcon_lab.training.validate.register_resolvers`, so a mistyped value fails at composition
  naming the key),
- what `FalconMixer` is built from (`FalconConfig(**knobs).resolved()`),
- and the start-up check (`training/validate.py` calls `resolved()` too).

A new knob is one field here (plus its use in the mixer and a line in the YAML). `resolved()` applies the
preset to the knobs left None, checks every value, and refuses a knob moved off its default where it has
no effect (the applicability rules below). Every error is a ValueError that starts with `mixer.<key>:`.
Choices marked (ours) are reconstructions the paper leaves open (falcon-math.md §3, docs/training.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from falcon_lab.kernels import FalconSpec

VARIANTS = ("1", "2", "3", "1A", "2A", "3A")
PRESETS = {
    ".1": {"qk_norm": "l2", "gate": "ctx_beta", "lam": "ctx"},
    ".2": {"qk_norm": "l2", "gate": "ctx_eta", "lam": "ctx"},
    ".3": {"qk_norm": "rmsnorm", "gate": "ctx_eta", "lam": "ctx"},
}
QK_NORMS = ("rmsnorm", "l2")
GATES = ("ctx_beta", "ctx_eta")
LAMS = ("ctx", "const", "off")
LAM_MODES = ("scaled", "absolute")
READS = ("after", "before")
BACKENDS = (None, "torch", "triton")
RECOMPUTE = ("auto", True, False)
DEFAULT_WINDOW = 4  # ours: the paper's "e.g., B = 4"


def normalize_preset(preset):
    """".3", "3", 3 and 0.3 (what Hydra makes of `mixer.preset=.3`) all mean the preset ".3"."""
    if preset is None or isinstance(preset, bool):
        return preset
    if isinstance(preset, (int, float)):
        preset = str(preset)
    p = str(preset).strip()
    if p.startswith("0."):
        p = p[1:]
    if p and not p.startswith("."):
        p = "." + p
    return p


def check_recompute(value):
    """mixer.recompute: auto | true | false (the strings Hydra may pass included)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not any(value is r or (isinstance(r, str) and value == r) for r in RECOMPUTE):
        raise ValueError(f"mixer.recompute: {value!r} is not one of auto, true, false")
    return value


def _err(key, msg):
    return ValueError(f"mixer.{key}: {msg}")


@dataclass
class FalconConfig:
    name: str = "falcon"
    variant: str = "1A"             # 1 | 2 | 3 (regression)  1A | 2A | 3A (inner product)
    preset: Optional[str] = ".3"    # .1 | .2 | .3: fills the knobs left None
    qk_norm: Optional[str] = None   # rmsnorm | l2
    qk_norm_gain: bool = False      # learnable per-head gain after the QK norm (ours)
    gate: Optional[str] = None      # ctx_beta (NLMS gain β) | ctx_eta (direct step η)
    lam: Optional[str] = None       # ctx | const | off
    lam_mode: str = "scaled"        # scaled: λ = λ̄·E_t | absolute (ours)
    lam_scale: float = 1.0          # λ̄ = lam_scale·σ(z) (ours)
    lam_value: float = 0.1          # λ for lam=const
    lam_init_bias: float = -2.0     # initial bias of the λ head (ours)
    window: Optional[int] = None    # B for variants 3 / 3A (None: 4, ours)
    shift: bool = True              # next-latent pairs (φ(k_{t-1}), v_t)
    read: str = "after"             # after | before
    eps: float = 1e-6               # ε in η = β/(E+λ+ε) (ours)
    eps_gamma: float = 1e-4         # decay clamp γ >= ε_γ (ours)
    eps_rms: float = 1e-6           # QK-norm ε (ours)
    beta_max: float = 2.0           # ctx_beta: β = beta_max·σ(z)
    eta_max: float = 1.0            # ctx_eta: η = eta_max/E_nom·σ(z) (ours)
    conv_size: int = 4              # short causal conv + SiLU on q/k/v (ours)
    output_norm: bool = True        # per-head output RMSNorm (ours)
    output_gate: bool = True        # SiLU output gate (ours)
    backend: Optional[str] = None   # the op's core: None | torch | triton
    chunk_size: int = 64
    module_backend: Optional[str] = None  # the layer modules: None | torch | triton
    recompute: Any = field(default="auto")  # auto | true | false (ours; see FalconMixer)

    # ------------------------------------------------------------------------------------------
    @classmethod
    def knobs(cls) -> dict:
        """{knob: default} of every field but `name`."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "name"}

    @classmethod
    def from_knobs(cls, knobs) -> "FalconConfig":
        """From a mapping of knobs (a `mixer` config section); unknown keys fail naming them."""
        known = cls.knobs()
        for k in knobs:
            if k != "name" and k not in known:
                raise _err(k, f"not a knob of mixer 'falcon' (knobs: {sorted(known)})")
        return cls(**{k: v for k, v in knobs.items() if k != "name"})

    def resolved(self) -> "FalconConfig":
        """A copy with the preset applied to the knobs left None, every value checked, and the
        applicability rules enforced (a knob moved off its default where it has no effect is an error)."""
        c = dataclasses.replace(self)
        c.variant = str(c.variant)
        c.preset = normalize_preset(c.preset)
        if c.variant not in VARIANTS:
            raise _err("variant", f"unknown Falcon variant {c.variant!r}; choose one of {VARIANTS}")
        if c.preset is not None and c.preset not in PRESETS:
            raise _err("preset", f"unknown preset {c.preset!r}; choose one of {sorted(PRESETS)} or null")
        p = PRESETS.get(c.preset, {})
        c.qk_norm = c.qk_norm if c.qk_norm is not None else p.get("qk_norm", "rmsnorm")
        c.gate = c.gate if c.gate is not None else p.get("gate", "ctx_eta")
        c.lam = c.lam if c.lam is not None else p.get("lam", "ctx")
        for key, allowed in (("qk_norm", QK_NORMS), ("gate", GATES), ("lam", LAMS), ("lam_mode", LAM_MODES),
                             ("read", READS), ("backend", BACKENDS), ("module_backend", BACKENDS)):
            if getattr(c, key) not in allowed:
                shown = tuple("null" if a is None else a for a in allowed)
                raise _err(key, f"{getattr(c, key)!r} is not one of {shown}")
        if FalconSpec.from_variant(c.variant).windowed:
            c.window = DEFAULT_WINDOW if c.window is None else c.window
            if isinstance(c.window, bool) or not isinstance(c.window, int) or c.window < 1:
                raise _err("window", f"must be an integer >= 1, got {c.window!r}")
        elif c.window is not None:
            raise _err("window", f"applies only to the sliding-window variants 3 and 3A, not variant "
                                 f"{c.variant!r} (leave it null)")
        for key in ("shift", "qk_norm_gain", "output_norm", "output_gate"):
            if not isinstance(getattr(c, key), bool):
                raise _err(key, f"must be true or false, got {getattr(c, key)!r}")
        for key in ("eps", "eps_gamma", "eps_rms", "lam_scale", "lam_value", "beta_max", "eta_max"):
            v = getattr(c, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise _err(key, f"must be a number >= 0, got {v!r}")
        if not 0 < c.eps_gamma <= 1:  # the operator's decay clamp
            raise _err("eps_gamma", f"must be in (0, 1], got {c.eps_gamma!r}")
        for key in ("conv_size", "chunk_size"):
            v = getattr(c, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _err(key, f"must be an integer >= 1, got {v!r}")
        c.recompute = check_recompute(c.recompute)
        self._check_applicability(c)
        return c

    @staticmethod
    def _check_applicability(c: "FalconConfig") -> None:
        rules = {
            "lam_value": (c.lam == "const", "mixer.lam=const"),
            "lam_scale": (c.lam == "ctx" and c.lam_mode == "scaled", "mixer.lam=ctx with mixer.lam_mode=scaled"),
            "lam_init_bias": (c.lam == "ctx", "mixer.lam=ctx"),
            "lam_mode": (c.lam != "off", "mixer.lam=ctx or const"),
            "beta_max": (c.gate == "ctx_beta", "mixer.gate=ctx_beta"),
            "eta_max": (c.gate == "ctx_eta", "mixer.gate=ctx_eta"),
            "eps": (c.gate == "ctx_beta", "mixer.gate=ctx_beta (the NLMS division; a direct step has no ε)"),
        }
        defaults = FalconConfig.knobs()
        for key, (applies, when) in rules.items():
            if getattr(c, key) != defaults[key] and not applies:
                raise _err(key, f"set to {getattr(c, key)!r} but it only has an effect with {when} "
                                f"(here gate={c.gate}, lam={c.lam}, lam_mode={c.lam_mode})")
