"""Compute layer: a Llama-family decoder (Llama, Qwen2/2.5, Qwen3) whose checkpoints are Hugging Face
safetensors directories, plus value/reward heads and device selection."""

from fuseflow.models.config import PRESETS, ModelConfig, RopeScaling
from fuseflow.models.device import resolve_device
from fuseflow.models.llama import CausalLM, CausalLMOutput, DecoderModel, KVCache, logprobs_of
from fuseflow.models.value import ValueModel, last_token_values

__all__ = [
    "PRESETS",
    "CausalLM",
    "CausalLMOutput",
    "DecoderModel",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "ValueModel",
    "last_token_values",
    "logprobs_of",
    "resolve_device",
]
