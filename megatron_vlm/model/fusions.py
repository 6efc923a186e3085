"""Kernel fusions of a training run: which ones are on, why, and what the TransformerConfigs receive.

Owns the table of megatron-core's fusion switches (Megatron-LM's flag names, the TransformerConfig field each one
sets, the sub-models it applies to) and :func:`resolve`, which turns the user's requests (``None``: automatic)
into effective values for a device and layer implementation:

- automatic: on where it works (CUDA; with Transformer Engine layers all of them, as Megatron-LM enables them,
  plus the fused cross-entropy), off where it cannot (CPU; local layers without the CUDA extension a fusion
  needs), each with the reason, which the trainer logs at start-up. Gradient-accumulation fusion with Transformer
  Engine layers but without apex's extension runs in TE's linears only (:attr:`Fusions.te_linears_only`: megatron's
  own output layer cannot build with it; Megatron-LM turns the fusion off altogether there);
- asked for where it cannot work: an error naming the flag and the fix.

Which sub-model gets what: the language model (SwiGLU, RoPE) takes every fusion. The vision encoder and projector
never get ``bias_activation_fusion``: megatron's fused bias-GELU is the tanh approximation (HF's CLIP projector
uses exact GELU, so logits would change) and quick-GELU / tanh-GELU without gating have no fused kernel; they
have no RoPE either. The cross-entropy belongs to the language model's output layer.

This module imports nothing heavy at import time (the launcher validates flags on hosts without torch).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

PARTS = ("language", "vision", "projector")


@dataclass(frozen=True)
class Fusion:
    name: str  # TrainConfig field and TransformerConfig field
    on_flag: str
    off_flags: tuple[str, ...]
    parts: tuple[str, ...]
    what: str


#: every switch, in the order they are logged; flag names as in Megatron-LM
FUSIONS = (
    Fusion("gradient_accumulation_fusion", "--gradient-accumulation-fusion", ("--no-gradient-accumulation-fusion",),
           PARTS, "weight-gradient GEMMs accumulate straight into the fp32 main_grad buffers"),
    Fusion("bias_activation_fusion", "--bias-swiglu-fusion", ("--no-bias-swiglu-fusion", "--no-bias-gelu-fusion"),
           ("language",), "fused (bias +) SwiGLU in the language model's MLP"),
    Fusion("bias_dropout_fusion", "--bias-dropout-fusion", ("--no-bias-dropout-fusion",), PARTS,
           "fused bias + dropout + residual add"),
    Fusion("apply_rope_fusion", "--rope-fusion", ("--no-rope-fusion",), ("language",),
           "Transformer Engine's fused rotary embedding (also for packed sequences)"),
    Fusion("masked_softmax_fusion", "--masked-softmax-fusion", ("--no-masked-softmax-fusion",), PARTS,
           "fused scale + mask + softmax in megatron's own attention"),
    Fusion("persist_layer_norm", "--persist-layer-norm", ("--no-persist-layer-norm",), PARTS,
           "persistent fused layer-norm kernel"),
    Fusion("cross_entropy_loss_fusion", "--cross-entropy-loss-fusion", ("--no-cross-entropy-loss-fusion",),
           ("language",), "megatron's fused vocab-parallel cross-entropy"),
)
BY_NAME = {f.name: f for f in FUSIONS}


def _imports(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def default_probes() -> dict[str, bool]:
    """What this machine has: Transformer Engine and the CUDA extensions megatron's local layers use."""
    from megatron_vlm.model.layer_impl import te_status

    return {
        "te": te_status()[0],
        "fused_weight_gradient_mlp_cuda": _imports("fused_weight_gradient_mlp_cuda"),  # apex --cuda_ext
        "scaled_upper_triang_masked_softmax_cuda": _imports("scaled_upper_triang_masked_softmax_cuda"),
    }


#: the reason of gradient-accumulation fusion with Transformer Engine layers and without apex's extension
TE_LINEARS_ONLY = ("Transformer Engine's linears (the output layer, megatron's own ColumnParallelLinear, stays unfused "
                   "without apex's fused_weight_gradient_mlp_cuda)")


@dataclass(frozen=True)
class _Needs:
    """Where a fusion runs on CUDA: with Transformer Engine layers (``with_te``: why; None: TE layers alone are not
    enough), else when the extension ``probe`` imports (``probe_ok``: why), else not (``missing``: why; ``fix``:
    what to do when it is asked for anyway, default: use TE layers)."""

    with_te: str | None
    probe: str | None
    probe_ok: str
    missing: str
    fix: str | None = None


#: fusions that need more than CUDA (the others run wherever CUDA does)
NEEDS = {
    # With TE layers: TE's linears fuse it themselves; the language model's output layer is megatron's own
    # ColumnParallelLinear even then, which refuses to build with the fusion unless apex's extension imports, so
    # without apex only the TE linears fuse (Fusions.te_linears_only, apply_to_te_linears).
    "gradient_accumulation_fusion": _Needs(
        TE_LINEARS_ONLY, "fused_weight_gradient_mlp_cuda", "apex fused_weight_gradient_mlp_cuda",
        "megatron's own linears (local layers; with Transformer Engine, the language model's output layer) need "
        "apex's fused_weight_gradient_mlp_cuda, which does not import",
        "install apex with its CUDA extensions"),
    "apply_rope_fusion": _Needs(
        None, "te", "Transformer Engine's fused RoPE",
        "megatron's fused RoPE is Transformer Engine's, which does not import"),
    "masked_softmax_fusion": _Needs(
        "Megatron-LM's default; Transformer Engine attention fuses the softmax itself",
        "scaled_upper_triang_masked_softmax_cuda", "megatron fused softmax kernels",
        "local attention needs the scaled_*_masked_softmax_cuda kernels, which do not import"),
    "persist_layer_norm": _Needs(
        "Megatron-LM's default (used by apex layer norms; Transformer Engine norms are fused)", None, "",
        "local layers use torch norms, which refuse it"),
}


def _availability(name: str, device: str, impl: str, probes: dict[str, bool]) -> tuple[bool, str]:
    """(can it run here, why) for fusion ``name``."""
    if device != "cuda":
        return False, f"device {device}: fused kernels run on CUDA only"
    needs = NEEDS.get(name)
    if needs is None:
        return True, "CUDA"
    if impl == "transformer_engine" and needs.with_te and not (needs.with_te == TE_LINEARS_ONLY and needs.probe
                                                               and probes.get(needs.probe)):
        return True, needs.with_te
    if needs.probe and probes.get(needs.probe):
        return True, needs.probe_ok
    return False, needs.missing


@dataclass
class Fusions:
    """Effective fusion switches: ``values[name]`` and ``reasons[name]`` for every entry of :data:`FUSIONS`."""

    values: dict[str, bool] = field(default_factory=lambda: {f.name: False for f in FUSIONS})
    reasons: dict[str, str] = field(default_factory=dict)
    #: on for Transformer Engine's linears only (gradient-accumulation fusion without apex): the TransformerConfigs
    #: get False, so that megatron's own linears build, and :meth:`apply_to_te_linears` turns it on in TE's
    te_linears_only: bool = False

    def config_kwargs(self, part: str) -> dict[str, bool]:
        """TransformerConfig keyword arguments for sub-model ``part`` (language, vision or projector)."""
        if part not in PARTS:
            raise ValueError(f"unknown sub-model {part!r}; one of {', '.join(PARTS)}")
        out = {f.name: bool(self.values[f.name]) and part in f.parts for f in FUSIONS}
        if self.te_linears_only:
            out["gradient_accumulation_fusion"] = False
        return out

    def apply_to_te_linears(self, model) -> int:
        """With :attr:`te_linears_only`: every Transformer Engine linear of ``model`` (megatron-core's TE wrappers:
        ``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``, ``TEColumnParallelLinear``, TE's grouped
        linears) accumulates its weight gradient inside the GEMM into the parameter's fp32 ``main_grad`` (TE's
        ``fuse_wgrad_accumulation``, which they take from the TransformerConfig's ``gradient_accumulation_fusion``
        when built and read at every forward); megatron's own linears are left as built. Returns how many
        linears it set (0 without it). Needs megatron-core DDP's ``main_grad`` buffers (training)."""
        if not (self.te_linears_only and self.values["gradient_accumulation_fusion"]):
            return 0
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

        n = 0
        for module in model.modules():
            if isinstance(module, TransformerEngineBaseModule) and hasattr(module, "fuse_wgrad_accumulation"):
                module.fuse_wgrad_accumulation = True
                n += 1
        return n

    def summary(self) -> str:
        """One line for the start-up log: ``name[, name...]=on|off (why)``, each reason said once (``all off
        (device cpu: ...)`` when every fusion shares it)."""
        groups: dict[tuple[bool, str], list[str]] = {}
        for f in FUSIONS:
            groups.setdefault((bool(self.values[f.name]), self.reasons.get(f.name, "")), []).append(f.name)
        parts = []
        for (on, why), names in groups.items():
            state = "on" if on else "off"
            who = f"all {state}" if len(names) == len(FUSIONS) else f"{', '.join(names)}={state}"
            parts.append(f"{who} ({why})" if why else who)
        return "; ".join(parts)


def requested(cfg) -> dict[str, bool | None]:
    """The user's requests from a TrainConfig (None: automatic)."""
    return {f.name: getattr(cfg, f.name, None) for f in FUSIONS}


def problems(req: dict[str, bool | None], device: str) -> list[str]:
    """Requests that cannot work on ``device`` whatever is installed (the launcher checks these before starting)."""
    return [f"{BY_NAME[n].on_flag} needs a CUDA GPU (fused kernels run on CUDA only); drop it for --device {device}"
            for n, v in req.items() if v and device != "cuda"]


def resolve(req: dict[str, bool | None], device: str, impl: str, probes: dict[str, bool] | None = None) -> Fusions:
    """Effective switches for ``req`` (name -> True/False/None) on ``device`` with layer implementation ``impl``.

    ``probes`` (default: :func:`default_probes` on CUDA) says what imports here. A fusion asked for where it
    cannot run raises ``ValueError`` naming its flag and the fix."""
    unknown = set(req) - set(BY_NAME)
    if unknown:
        raise ValueError(f"unknown fusion(s) {sorted(unknown)}; known: {', '.join(BY_NAME)}")
    if probes is None:
        probes = default_probes() if device == "cuda" else {}
    out = Fusions()
    for f in FUSIONS:
        ok, why = _availability(f.name, device, impl, probes)
        want = req.get(f.name)
        if want and not ok:
            needs = NEEDS.get(f.name)
            if device != "cuda":
                fix = "run on --device cuda"
            else:
                fix = needs.fix if needs and needs.fix else "use --transformer-impl transformer_engine on a CUDA GPU"
            raise ValueError(f"{f.on_flag} cannot run here: {why}; drop it, or {fix}")
        if want is None:
            out.values[f.name], out.reasons[f.name] = ok, ("automatic: " + why)
        else:
            out.values[f.name] = bool(want)
            out.reasons[f.name] = f.on_flag if want else f.off_flags[0]
        if f.name == "gradient_accumulation_fusion" and out.values[f.name] and why == TE_LINEARS_ONLY:
            out.te_linears_only = True
            if want:
                out.reasons[f.name] += f" ({TE_LINEARS_ONLY})"
    return out
