"""Typed, frozen configuration of the Llama-family decoder and its Hugging Face mapping.

One `ModelConfig` describes Llama, Qwen2/2.5 and Qwen3 checkpoints. The three families
differ only in a few switches (qkv bias, per-head qk-norm, tied embeddings, head_dim),
so the switches that a family fixes are derived from `architecture` and checked, never
left for the user to get wrong.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Architecture = Literal["llama", "qwen2", "qwen3"]

# Hugging Face class name and model_type for each supported family.
HF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_HF_CLASS_TO_ARCH = {v: k for k, v in HF_ARCHITECTURES.items()}
SUPPORTED_HF = ", ".join(f"{cls} (model_type '{arch}')" for arch, cls in HF_ARCHITECTURES.items())


class RopeScaling(BaseModel):
    """Frequency rescaling for long-context checkpoints (HF `rope_type` 'linear' or 'llama3').

    Llama 3.1/3.2 ship with 'llama3' scaling; loading them without it would silently
    change every logit, so it is modelled rather than dropped.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rope_type: Literal["linear", "llama3"]
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_position_embeddings: int = Field(default=8192, gt=0)


class ModelConfig(BaseModel):
    """Shape and options of one decoder; validated once, never mutated.

    Derived fields: `head_dim` defaults to hidden_size / num_attention_heads,
    `num_key_value_heads` to num_attention_heads, `qk_norm` is True exactly for qwen3,
    `attention_bias` is always True for qwen2 (its HF class hard-wires q/k/v biases).

    Example:
        >>> cfg = ModelConfig.preset("tiny", vocab_size=40)
        >>> cfg.head_dim, cfg.num_key_value_heads
        (32, 2)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Architecture = "llama"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_position_embeddings: int = Field(default=2048, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    initializer_range: float = Field(default=0.02, gt=0)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _derive(cls, data: Any) -> Any:
        # Fill derived fields before validation so the frozen model stores concrete ints/bools.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        arch = data.get("architecture", "llama")
        heads = data.get("num_attention_heads")
        if data.get("num_key_value_heads") is None:
            data["num_key_value_heads"] = heads
        if data.get("head_dim") is None:
            hidden = data.get("hidden_size")
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                if hidden % heads:
                    raise ValueError(
                        f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
                        "set head_dim explicitly or pick divisible sizes"
                    )
                data["head_dim"] = hidden // heads
        want_qk = arch == "qwen3"
        if data.get("qk_norm") is None:
            data["qk_norm"] = want_qk
        elif bool(data["qk_norm"]) != want_qk:
            raise ValueError(
                f"qk_norm={data['qk_norm']} does not match architecture={arch!r}: qk-norm is always on "
                "for qwen3 and absent for llama/qwen2; leave qk_norm unset"
            )
        if arch == "qwen2":
            if data.get("attention_bias") is False:
                raise ValueError(
                    "attention_bias=False is impossible for architecture='qwen2' (HF Qwen2 always has "
                    "q/k/v biases); use architecture='llama' for a bias-free model"
                )
            data["attention_bias"] = True
        elif data.get("attention_bias") is None:
            data["attention_bias"] = False
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        return self

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: Llama/Qwen3 tie it to attention_bias, Qwen2 never has one."""
        return self.attention_bias and self.architecture != "qwen2"

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides: Any) -> ModelConfig:
        """Build a named size preset ('tiny' about 0.8M params, 'small' about 20M) for training from scratch.

        Example:
            >>> ModelConfig.preset("small", vocab_size=64, architecture="qwen3").num_hidden_layers
            8
        """
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], "vocab_size": vocab_size, **overrides})

    # ------------------------------------------------------------------ HF mapping
    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """The `config.json` dict HF's `<Family>ForCausalLM` expects (transformers 4.45+ and 5.x keys).

        `dtype` is the stored weight dtype name, written both as `torch_dtype` (4.x) and `dtype` (5.x).
        """
        rope_params: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope_scaling = None
        if self.rope_scaling is not None:
            rope_scaling = self.rope_scaling.model_dump()
            if self.rope_scaling.rope_type == "linear":
                rope_scaling = {"rope_type": "linear", "factor": self.rope_scaling.factor}
            rope_params = {**rope_scaling, "rope_theta": self.rope_theta}
        out: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_params,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype,
            "dtype": dtype,
        }
        if self.architecture == "llama":
            out.update(attention_bias=self.attention_bias, mlp_bias=False, pretraining_tp=1)
        else:
            # Qwen families: full attention everywhere (no sliding-window layers).
            out.update(
                use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers
            )
            if self.architecture == "qwen3":
                out["attention_bias"] = self.attention_bias
        return out

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a HF `config.json` dict of a Llama / Qwen2 / Qwen3 causal LM.

        Options this decoder cannot reproduce exactly (sliding windows, MLP bias, other
        activations, other RoPE types, quantization) raise instead of loading wrong logits.
        """
        arch = _architecture_of(d)
        unsupported = {
            "hidden_act": (d.get("hidden_act", "silu"), "silu"),
            "mlp_bias": (bool(d.get("mlp_bias", False)), False),
            "use_sliding_window": (bool(d.get("use_sliding_window", False)), False),
        }
        for key, (got, allowed) in unsupported.items():
            if got != allowed:
                raise ValueError(f"config.json {key}={got!r} is not supported; only {allowed!r} is")
        if "quantization_config" in d:
            raise ValueError("quantized checkpoints are not supported; load an unquantized (bf16/fp32) one")
        theta, scaling = _read_rope(d)
        fields = {
            "architecture": arch,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
            "attention_bias": True if arch == "qwen2" else bool(d.get("attention_bias", False)),
        }
        for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
            "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
        ):  # fmt: skip
            if d.get(key) is not None:
                fields[key] = d[key]
        return cls(**fields)


def _architecture_of(d: dict[str, Any]) -> Architecture:
    model_type = d.get("model_type")
    classes = d.get("architectures") or []
    for name in classes:
        if name in _HF_CLASS_TO_ARCH:
            return _HF_CLASS_TO_ARCH[name]  # type: ignore[return-value]
    if model_type in HF_ARCHITECTURES and not classes:
        return model_type  # type: ignore[return-value]
    raise ValueError(
        f"unsupported checkpoint: architectures={classes!r}, model_type={model_type!r}; "
        f"supported are {SUPPORTED_HF}"
    )


def _read_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5.x nests everything in rope_parameters; 4.x has rope_theta + rope_scaling.
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    source = params if params.get("rope_type", "default") != "default" else scaling
    rope_type = source.get("rope_type", source.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(
            f"config.json rope_type={rope_type!r} is not supported; use 'default', 'linear' or 'llama3'"
        )
    keys = RopeScaling.model_fields.keys()
    return float(theta), RopeScaling(
        **{k: v for k, v in source.items() if k in keys} | {"rope_type": rope_type}
    )


# Size presets for training from scratch. Real counts (tied embeddings) are pinned in tests/test_models.py.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
    ),
}  # fmt: skip
