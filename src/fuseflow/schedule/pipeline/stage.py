"""One pipeline stage of fuseflow's decoder: a contiguous run of its layers, plus the
embeddings on the first stage and the final norm and head on the last.

Kept outside the model code (torchtitan style): a stage is cut from a whole `CausalLM` or
`ValueModel` and keeps the original parameter names (`model.layers.5.mlp...`), so a
stage's state dict is a slice of the single-process one and the two compare key by key.
With tied embeddings the first and last stage each hold a copy of the shared matrix;
the executor sums their gradients so both copies take the same step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fuseflow.models.llama import CausalLM, build_attention_mask, rope_cos_sin, rope_inv_freq
from fuseflow.models.value import ValueModel


def split_layers(weights: list[int], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Layer counts per stage, contiguous, minimising the largest stage's parameter count.

    `weights` are the decoder layers' parameter counts; `first_extra` / `last_extra` are
    the parameters only the first / last stage holds (embeddings; final norm and head).
    Every stage gets at least one layer. Exhaustive dynamic programme over cut points,
    ties broken towards earlier cuts.
    Example: `split_layers([1, 1, 1, 1], 2, last_extra=2)` is [3, 1].
    """
    n = len(weights)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages: need 1 <= stages <= layers")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(a: int, b: int, k: int) -> int:  # stage k holds layers a..b-1
        return prefix[b] - prefix[a] + (first_extra if k == 0 else 0) + (last_extra if k == n_stages - 1 else 0)

    inf = float("inf")
    # best[k][i]: least max cost of the first k stages covering layers 0..i-1.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], cost(j, i, k - 1))
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    counts, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def balanced_split(model: CausalLM | ValueModel, n_stages: int) -> list[int]:
    """`split_layers` for a whole model: embeddings count on the first stage, the final
    norm and the head (LM head or value head) on the last."""
    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    head = model.lm_head if isinstance(model, CausalLM) else model.value_head
    return split_layers(
        [size(layer) for layer in model.model.layers], n_stages,
        first_extra=size(model.model.embed_tokens), last_extra=size(model.model.norm) + size(head),
    )


class StageModule(nn.Module):
    """Layers `first_layer .. first_layer + n - 1` of `full`, with its embeddings if `first`
    and its norm and head if `last`. Parameters are the full model's (not copies): build
    one stage per process from a model that process owns.

    `forward(x, attention_mask, position_ids)` takes token ids (B, T) on the first stage and
    hidden states (B, T, hidden) elsewhere; it returns hidden states, or on the last stage
    logits (B, T, V) for a `CausalLM` and values (B, T) in fp32 for a `ValueModel`.
    """

    def __init__(self, full: CausalLM | ValueModel, first_layer: int, n_layers: int, first: bool, last: bool):
        super().__init__()
        self.config = full.config
        self.first, self.last = first, last
        self.is_value = isinstance(full, ValueModel)
        self.layer_ids = list(range(first_layer, first_layer + n_layers))
        self.model = nn.Module()
        # ModuleDict keyed by the original index keeps the full model's parameter names.
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in self.layer_ids})
        if first:
            self.model.embed_tokens = full.model.embed_tokens
        if last:
            self.model.norm = full.model.norm
            if self.is_value:
                self.value_head = full.value_head
            else:
                self.lm_head = full.lm_head

    def forward(self, x: Tensor, attention_mask: Tensor | None, position_ids: Tensor) -> Tensor:
        # The same steps as DecoderModel.forward without a KV cache (training and scoring).
        h = self.model.embed_tokens(x) if self.first else x  # (B, T, hidden)
        t = h.shape[1]
        cos, sin = rope_cos_sin(position_ids, rope_inv_freq(self.config, h.device), h.dtype)
        mask = build_attention_mask(attention_mask, t, 0)
        for i in self.layer_ids:
            h, _ = self.model.layers[str(i)](h, cos, sin, mask, None)
        if not self.last:
            return h
        h = self.model.norm(h)
        if self.is_value:
            return self.value_head(h).squeeze(-1).float()  # (B, T)
        return self.lm_head(h)  # (B, T, V)


    def forward_cached(
        self, x: Tensor, attention_mask: Tensor, position_ids: Tensor, past: list[tuple[Tensor, Tensor]] | None
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """Generation step with this stage's KV cache (one (k, v) per layer; None for a prefill).

        Returns hidden states (B, T, hidden), or on the last stage the logits of the last
        position only (B, V) in fp32, plus the extended cache. Same steps as
        DecoderModel.forward with `use_cache=True`, including its unmasked single-token path.
        """
        h = self.model.embed_tokens(x) if self.first else x
        t = h.shape[1]
        past_len = 0 if past is None else past[0][0].shape[2]
        cos, sin = rope_cos_sin(position_ids, rope_inv_freq(self.config, h.device), h.dtype)
        mask = build_attention_mask(attention_mask, t, past_len)
        if mask is not None and t == 1 and bool(attention_mask.all()):
            mask = None
        cache = []
        for j, i in enumerate(self.layer_ids):
            h, kv = self.model.layers[str(i)](h, cos, sin, mask, None if past is None else past[j])
            cache.append(kv)
        if not self.last:
            return h, cache
        return self.lm_head(self.model.norm(h)[:, -1:]).squeeze(1).float(), cache


def build_stage(full: CausalLM | ValueModel, stage: int, n_stages: int, split: list[int] | None = None) -> StageModule:
    """Stage `stage` of `n_stages` of `full`, split by `split` (layers per stage) or balanced
    by parameter count. The rest of `full` is left to the garbage collector by the caller."""
    counts = balanced_split(full, n_stages) if split is None else list(split)
    if len(counts) != n_stages or sum(counts) != full.config.num_hidden_layers or min(counts) < 1:
        raise ValueError(
            f"split={counts} is invalid: it needs {n_stages} positive layer counts summing to "
            f"{full.config.num_hidden_layers}"
        )
    first_layer = sum(counts[:stage])
    return StageModule(full, first_layer, counts[stage], first=stage == 0, last=stage == n_stages - 1)


def tied_name(stage: StageModule) -> str | None:
    """Name of this stage's copy of the tied embedding matrix, if the model ties it and
    the stage holds one (the first stage's embedding or the last stage's LM head)."""
    if stage.is_value or not stage.config.tie_word_embeddings:
        return None
    if stage.first:
        return "model.embed_tokens.weight"
    if stage.last:
        return "lm_head.weight"
    return None


@torch.no_grad()
def full_state(stages: list[StageModule]) -> dict[str, Tensor]:
    """The union of several stages' state dicts (tied copies appear under both names)."""
    out: dict[str, Tensor] = {}
    for s in stages:
        out.update({k: v.detach().clone() for k, v in s.state_dict().items()})
    return out
