"""Value model (PPO critic) and reward model: the decoder backbone plus a scalar head per position."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from fuseflow.models import hf_io
from fuseflow.models.attention import SharedPrefix, Unpadded
from fuseflow.models.config import ModelConfig
from fuseflow.models.llama import CausalLM, DecoderModel, init_weights

VALUE_ARCHITECTURE = "FuseflowValueModel"


class ValueModel(nn.Module):
    """Backbone (`self.model`, HF-style names) + `value_head` Linear(hidden, 1): one scalar per token.

    As a critic, `forward` gives V(s_t) at every position; as a reward model, read the score at
    the last real token with `last_token_values`.

    Example:
        >>> lm = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=40))
        >>> critic = ValueModel.from_causal_lm(lm)
        >>> critic(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3])
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.value_head = nn.Linear(config.hidden_size, 1)

    def forward(
        self,
        input_ids: Tensor,  # (B, T)
        attention_mask: Tensor | None = None,  # (B, T), 1 = real token; left padding allowed
        position_ids: Tensor | None = None,  # (B, T)
        unpadded: Unpadded | SharedPrefix | None = None,
        values_to_keep: Tensor | None = None,  # (M,) positions of T whose values are wanted
    ) -> Tensor:
        """Values (B, T) in fp32 (losses and GAE want full precision even when the model runs in bf16).

        ``unpadded``: a packed (1, N) input of a padded batch (see `DecoderModel.forward`);
        ``values_to_keep``: only those positions go through the head, giving (B, M).
        """
        h, _ = self.model(input_ids, attention_mask, position_ids, unpadded=unpadded)
        if values_to_keep is not None:
            h = h[:, values_to_keep]
        return self.head(h)

    def head(self, h: Tensor) -> Tensor:
        """Values (...) in fp32 of final-norm hidden states (..., hidden): the value head alone."""
        return self.value_head(h).squeeze(-1).float()

    def zero_head(self) -> None:
        """Start from V = 0 everywhere. A random head would add noise of its own to the first advantages
        (GAE subtracts V); a zero head is a neutral baseline, and its weight still gets a gradient at
        once (dL/dw = error * hidden), so the backbone starts learning from the second step."""
        with torch.no_grad():
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of parameter elements of the backbone and value head; ``trainable_only``: those with
        ``requires_grad`` only."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @classmethod
    def from_causal_lm(cls, lm: CausalLM) -> ValueModel:
        """Critic initialised from a policy: an independent, trainable copy of its backbone and a zero head."""
        with torch.device("meta"):  # skip a random init that would be thrown away at once
            critic = cls(lm.config)
        critic.model = copy.deepcopy(lm.model)
        w = lm.model.embed_tokens.weight
        critic.value_head = nn.Linear(lm.config.hidden_size, 1, device=w.device, dtype=w.dtype)
        critic.zero_head()
        return critic.requires_grad_(True)

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> ValueModel:
        """Random backbone (N(0, initializer_range)) with a zero head, for critics or reward models trained from scratch."""
        vm = cls(config)
        init_weights(vm, config.initializer_range, seed)
        vm.zero_head()
        return vm.to(device=device, dtype=dtype)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> ValueModel:
        """Load a directory written by `save_pretrained` (config.json marks it as a fuseflow value model)."""
        hf_cfg = hf_io.read_hf_config(path)
        if not hf_cfg.get(hf_io.VALUE_MODEL_KEY):
            raise ValueError(
                f"{path} is not a fuseflow value model (no '{hf_io.VALUE_MODEL_KEY}' in config.json); to start a "
                "critic from a language model use ValueModel.from_causal_lm(CausalLM.from_pretrained(path))"
            )
        config = ModelConfig.from_hf_dict({**hf_cfg, "architectures": []})  # backbone family from model_type
        with torch.device("meta"):
            vm = cls(config)
        device, dtype = hf_io.resolve_load_target(device, dtype)
        hf_io.load_state_into(vm, hf_io.read_safetensors(path, device), device=device, dtype=dtype)
        return vm

    def save_pretrained(self, path: str | Path) -> None:
        """Safetensors + config.json (backbone's HF fields, plus the value-model marker); atomic."""
        hf_cfg = self.config.to_hf_dict(hf_io.dtype_name(self.model.embed_tokens.weight.dtype))
        # The backbone's model_type stays, so HF's AutoModel can still load the backbone alone.
        hf_cfg.update({"architectures": [VALUE_ARCHITECTURE], hf_io.VALUE_MODEL_KEY: True})
        hf_io.save_checkpoint(path, hf_cfg, self.state_dict())


def last_token_values(values: Tensor, attention_mask: Tensor) -> Tensor:
    """Value at each row's last real token: (B, T), (B, T) -> (B,). Works with left and right padding.

    This is the reward-model score of a whole sequence.
    Example: values [[0, 5, 7, 0]] with mask [[0, 1, 1, 0]] -> [7].
    """
    if values.shape != attention_mask.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and attention_mask {tuple(attention_mask.shape)} differ"
        )
    mask = attention_mask.bool()
    if not bool(mask.any(-1).all()):
        raise ValueError("attention_mask has a row with no real token; every sequence needs at least one")
    positions = torch.arange(values.shape[-1], device=values.device)
    last = torch.where(mask, positions, -1).argmax(-1)  # (B,) index of the last 1
    return values.gather(-1, last[:, None]).squeeze(-1)
