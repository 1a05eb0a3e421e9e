"""LoRA adapters on fuseflow's decoder, by peft, in peft's file format.

peft's ``inject_adapter_in_model`` works on any module tree with ``nn.Linear`` leaves, and the
decoder's module names are Hugging Face's, so peft wraps ``model.layers.{i}.self_attn.q_proj``
exactly as it does in ``LlamaForCausalLM``: adapter weights are ``lora_A`` (r, in), kaiming-initialised,
and ``lora_B`` (out, r), zero-initialised, with scaling alpha / r and dropout on the input of A. A
saved adapter (``adapter_model.safetensors`` with keys ``base_model.model.<path>.lora_A.weight``,
plus ``adapter_config.json``) is what ``peft.PeftModel.from_pretrained`` reads.

Beyond peft, this file holds what fuseflow's roles need without copying the frozen base:
``base_view`` (a plain ``CausalLM`` whose parameters are the adapted model's base tensors: the
reference model), ``lora_parts`` (the engine's on-the-fly adapter path) and ``merged_model``
(export). peft is imported lazily: runs without LoRA never load it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import MethodType

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from fuseflow.models.config import ModelConfig
from fuseflow.models.llama import CausalLM

ADAPTER = "default"  # peft's adapter name; one adapter per model here
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # how PeftModel nests the base model: the prefix of every saved key
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """The adapter's shape: ``rank`` r, ``alpha`` (scaling alpha / r), input ``dropout`` and target module names."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        """alpha / r, the factor on the adapter's product: an adapted layer computes ``W x + scaling * B A x``."""
        return self.alpha / self.rank

    def peft_config(self, base_path: str | None = None):
        """The ``peft.LoraConfig`` of this spec (task CAUSAL_LM, bias none: only A and B train)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.targets), bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_path)


def targetable_names() -> list[str]:
    """Names of the decoder layers' linear modules (what ``targets`` may name), in model order."""
    with torch.device("meta"):
        layer = CausalLM(ModelConfig.preset("tiny", vocab_size=8, num_hidden_layers=1)).model.layers[0]
    return [n.rsplit(".", 1)[-1] for n, m in layer.named_modules() if isinstance(m, nn.Linear)]


def unmatched_targets(targets: tuple[str, ...] | list[str]) -> list[str]:
    """Targets that name no linear module of a decoder layer (peft's rule: the module name or its last part)."""
    names = targetable_names()
    return [t for t in targets if t.rsplit(".", 1)[-1] not in names]


def apply_lora(model: CausalLM, spec: LoraSpec, seed: int = 0) -> CausalLM:
    """Inject adapters into ``model`` in place (peft) and freeze everything else; returns ``model``.

    A is drawn from a generator seeded by ``seed`` (the global RNG is left as it was), so the same
    seed gives the same adapters, and B is zero: at first the adapted model equals the base.
    """
    from peft import inject_adapter_in_model

    bad = unmatched_targets(spec.targets)
    if bad:
        raise ValueError(f"model.lora.targets: {bad[0]!r} matches no module of the decoder; "
                         f"choose from {', '.join(targetable_names())}")
    if spec.rank <= 0:
        raise ValueError(f"model.lora.rank must be a positive integer, got {spec.rank}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(spec.peft_config(), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    for layer in lora_layers(model).values():
        layer.forward = MethodType(_scoring_forward, layer)
    model.lora_spec = spec
    return model


def _scoring_forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    """peft's forward, except for a forward without autograd over many rows: ``x (W + s B A)^T``.

    Scoring (old log-probs, evaluation) runs the adapted model on whole batches of tokens; there
    the two thin products per layer and the extra passes over the output cost about a third of the
    base forward, while forming ``W + s B A`` for the one product (a temporary of the layer's size,
    freed after it) costs ``r / rows`` of it. Training forwards (autograd on), dropout in train mode,
    autocast, and inputs with fewer rows than ``in * out / (in + out)`` take peft's own path.
    """
    parts = lora_parts(self)
    if (parts is None or args or kwargs or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
            or (self.training and not isinstance(self.lora_dropout[ADAPTER], nn.Identity))):
        return type(self).forward(self, x, *args, **kwargs)
    a, b, scaling = parts  # (r, in), (out, r)
    rows = x.numel() // x.shape[-1]
    if rows * (a.shape[1] + b.shape[0]) < a.shape[1] * b.shape[0]:
        return type(self).forward(self, x)
    base = self.base_layer
    return F.linear(x, torch.addmm(base.weight, b, a, alpha=scaling), base.bias)


def lora_spec(model: nn.Module) -> LoraSpec | None:
    """The spec ``apply_lora`` gave ``model``, or None for a plain model."""
    return getattr(model, "lora_spec", None)


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module path (HF name, e.g. ``model.layers.0.self_attn.q_proj``) -> peft LoRA layer."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and ADAPTER in m.lora_A}


def lora_parts(layer: nn.Module) -> tuple[Tensor, Tensor, float] | None:
    """(A (r, in), B (out, r), scaling) of an active adapter on ``layer``; None for a plain ``nn.Linear``.

    The engine adds ``scaling * (x A^T) B^T`` to the base product itself (an on-the-fly adapted
    forward: no merged copy, and the base tensors the reference shares are never written).
    """
    a = getattr(layer, "lora_A", None)
    if a is None or ADAPTER not in a or layer.disable_adapters or layer.merged:
        return None
    return a[ADAPTER].weight, layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER]


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter weights under peft's saved names: ``base_model.model.<path>.lora_A.weight`` / ``lora_B``."""
    out = {}
    for name, m in lora_layers(model).items():
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A[ADAPTER].weight
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B[ADAPTER].weight
    return out


def save_adapter(model: nn.Module, path: str | Path, base_path: str | Path | None = None) -> None:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` into ``path`` (atomically, as peft lays them out)."""
    spec = lora_spec(model)
    if spec is None:
        raise ValueError("save_adapter: the model has no LoRA adapters (see apply_lora)")
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.adapter-", dir=target.parent))
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter_state_dict(model).items()}
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        spec.peft_config(str(base_path) if base_path else None).save_pretrained(str(tmp))
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):  # weights before config: a config means complete
            os.replace(tmp / name, target / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a LoRA adapter rather than a full model: its ``adapter_config.json`` exists
    (``save_adapter`` moves it in after the weights, so it marks a complete save)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_spec(path: str | Path) -> LoraSpec:
    """The ``LoraSpec`` of a saved adapter (a peft ``adapter_config.json``)."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"no {ADAPTER_CONFIG} in {path!s}; expected a LoRA adapter directory")
    cfg = json.loads(file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {cfg['peft_type']!r} is not LORA")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    return LoraSpec(int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout", 0.0)),
                    tuple(sorted(targets, key=_target_order)))


def _target_order(name: str) -> int:
    names = targetable_names()
    return names.index(name) if name in names else len(names)


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path) -> None:
    """Copy a saved adapter's A and B into ``model``'s adapters (same targets and rank), in place."""
    layers = lora_layers(model)
    state = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    expected = set(adapter_state_dict(model))
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"{path}: adapter does not match the model's LoRA targets: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    for key, value in state.items():
        name, part = key[len(PEFT_PREFIX):].rsplit(".", 2)[:2]
        p = getattr(layers[name], part)[ADAPTER].weight
        if p.shape != value.shape:
            raise ValueError(f"{key}: adapter shape {tuple(value.shape)} != model shape {tuple(p.shape)}")
        p.copy_(value)


def _base_state(model: nn.Module, keep_vars: bool) -> dict[str, Tensor]:
    """The base model's state under plain HF names (``...q_proj.weight``), adapters left out."""
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict(keep_vars=keep_vars).items()
            if ".lora_" not in k}


def base_view(model: CausalLM) -> CausalLM:
    """A plain ``CausalLM`` whose parameters ARE ``model``'s frozen base tensors (no copy): the reference.

    It never sees the adapters and shares nothing that changes, so it may run on another thread
    while the adapted model trains (fused and async modes), with no adapter toggling to race on.
    """
    with torch.device("meta"):
        view = CausalLM(model.config)
    state = _base_state(model, keep_vars=True)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    view.load_state_dict(state, strict=False, assign=True)
    view.tie_weights()
    return view.eval().requires_grad_(False)


@torch.no_grad()
def merged_model(model: CausalLM) -> CausalLM:
    """A new plain ``CausalLM`` with W + scaling * B @ A in every adapted layer (a full copy: for export)."""
    state = {k: v.detach().clone() for k, v in _base_state(model, keep_vars=False).items()}
    for name, layer in lora_layers(model).items():
        a, b, s = lora_parts(layer)
        w = state[f"{name}.weight"]
        state[f"{name}.weight"] = (w.float() + s * (b.float() @ a.float())).to(w.dtype)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        out = CausalLM(model.config)
    out.load_state_dict(state, strict=False, assign=True)
    out.tie_weights()
    return out
