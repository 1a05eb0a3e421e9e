"""Model specs: the few shape numbers a cost model needs, from a preset or a config.json.

Counts follow the Llama-family decoder: attention with grouped KV heads, a SwiGLU MLP
(three matrices), two RMSNorms per layer, token embedding and an LM head (or a scalar
value head for critics and reward models). Preset shapes are copied from the public
Hugging Face ``config.json`` of each model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder. `head="value"` swaps the LM head for a 1-output value head.

    Example:
        >>> m = get_model("llama-7b")
        >>> round(m.params / 1e9, 2)
        6.74
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool = False
    qkv_bias: bool = False
    head: Literal["lm", "value"] = "lm"

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name}: {f}={getattr(self, f)!r} must be > 0")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    # ---------------------------------------------------------------- parameter counts
    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: q, k, v, o projections, SwiGLU MLP, two norms."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return attn + bias + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def head_params(self) -> int:
        """Output head: the LM head (free when tied to the embedding) or a scalar value head."""
        if self.head == "value":
            return self.hidden + 1
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters: layers, embedding, final norm and head."""
        return self.layers * self.layer_params + self.vocab * self.hidden + self.hidden + self.head_params

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the embedding is a lookup).

        A tied LM head is still a (hidden x vocab) matmul, so it counts here.
        """
        head = self.vocab * self.hidden if self.head == "lm" else self.hidden
        return self.layers * (self.layer_params - 2 * self.hidden) + head

    # ---------------------------------------------------------------- FLOPs and bytes
    def forward_flops(self, tokens: float, attended: float) -> float:
        """FLOPs of a forward pass over `tokens` tokens that attend `attended` keys in total.

        2 FLOPs per matmul parameter per token (Kaplan et al. 2020, "C_forward = 2N"),
        plus QK^T and AV: 2 matmuls x 2 FLOPs x heads x head_dim per (query, key) pair.
        """
        return 2.0 * self.matmul_params * tokens + 4.0 * self.layers * self.heads * self.head_dim * attended

    def sequence_forward_flops(self, seq_len: float) -> float:
        """Forward FLOPs of one causal sequence of `seq_len` tokens (query i attends i keys)."""
        return self.forward_flops(seq_len, seq_len * (seq_len + 1) / 2.0)

    def kv_bytes_per_token(self, dtype_bytes: int) -> float:
        """KV-cache bytes per token: K and V, per layer, per KV head."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int) -> float:
        """Bytes of all parameters (`params`) stored at `dtype_bytes` bytes each."""
        return float(self.params) * dtype_bytes

    def as_value_model(self) -> ModelSpec:
        """The same trunk with a scalar head: how critics and reward models are built."""
        return replace(self, head="value", name=f"{self.name}:value")


def _spec(name, hidden, layers, heads, kv, ffn, vocab, tied=False, bias=False) -> ModelSpec:
    return ModelSpec(name, hidden, layers, heads, kv, ffn, vocab, tied_embeddings=tied, qkv_bias=bias)


# Shapes from each model's Hugging Face config.json (llama-33b is LLaMA-1 "30B").
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-7b": _spec("llama-7b", 4096, 32, 32, 32, 11008, 32000),
    "llama-13b": _spec("llama-13b", 5120, 40, 40, 40, 13824, 32000),
    "llama-33b": _spec("llama-33b", 6656, 60, 52, 52, 17920, 32000),
    "llama-65b": _spec("llama-65b", 8192, 80, 64, 64, 22016, 32000),
    "llama-70b": _spec("llama-70b", 8192, 80, 64, 8, 28672, 32000),
    "qwen2.5-0.5b": _spec("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, tied=True, bias=True),
    "qwen2.5-1.5b": _spec("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, tied=True, bias=True),
    "qwen2.5-3b": _spec("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, tied=True, bias=True),
    "qwen2.5-7b": _spec("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, bias=True),
    "qwen2.5-32b": _spec("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, bias=True),
    "qwen2.5-72b": _spec("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, bias=True),
}


def model_names() -> list[str]:
    """Preset names accepted by `get_model` (and `--model`)."""
    return list(MODEL_PRESETS)


def get_model(name: str) -> ModelSpec:
    """A preset by name, or a model directory / config.json path (Hugging Face format)."""
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return from_hf_config(json.loads(path.read_text()), name=path.parent.name or path.stem)
    raise ValueError(f"model {name!r}: unknown; choose one of: {', '.join(model_names())} or a config.json path")


def from_hf_config(cfg: dict, name: str = "custom") -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json mapping (Llama / Qwen2 style).

    Example:
        >>> from_hf_config({"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        ...                 "intermediate_size": 384, "vocab_size": 40}).kv_heads
        4
    """
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"model config {name!r}: missing keys {missing}; a Hugging Face config.json has them")
    heads = int(cfg["num_attention_heads"])
    model_type = str(cfg.get("model_type", ""))
    return ModelSpec(
        name=name,
        hidden=int(cfg["hidden_size"]),
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        ffn=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]),
        head_dim=int(cfg.get("head_dim") or 0),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
    )
