"""``Batch``: what crosses every stage and worker boundary.

A batch is a dict of tensors sharing the batch dimension plus per-sample metadata
lists. Sequences use one layout everywhere (as verl does): the prompt left-padded to
``Tp`` tokens followed by the response right-padded to ``Tr`` tokens, so response
token ``j`` sits at column ``Tp + j`` and is predicted by the logits at ``Tp + j - 1``.
Every ``(B, Tr)`` field below holds 0 (or anything: it is masked) past a response's
end; only positions where ``response_mask`` is 1 count.

Tensor fields, in the order one RL step (``RLTrainer.step``) fills them
(B = samples, Tp = prompt width, Tr = response width, all float32 unless said):

  from the rollout (``workers.common.samples_to_batch``):
    input_ids          (B, Tp+Tr) long  prompt token ids (left-padded) then response ids (right-padded)
    attention_mask     (B, Tp+Tr) long  1 on real tokens of prompt and response, 0 on padding
    response_mask      (B, Tr)          1 on response tokens that count (the eos included), 0 on padding
    behavior_logprobs  (B, Tr)          log-prob of each sampled token under the policy that sampled it
                                        (the rollout backend at the rollout temperature); the
                                        behaviour policy of ``decoupled_policy_loss``
  from the reward worker (``workers.reward.RewardOutput``), per sample:
    scores             (B,)             the reward the advantages see: ``reward.model_weight * rm_scores +
                                        reward.fn_weight * fn_scores`` plus DAPO's overlong shaping; NaN when
                                        the task function returned a non-finite value (the update is skipped)
    correct            (B,)             1.0 where the task function's reward reaches its success threshold
    fn_scores          (B,)             the task's reward function (the hidden gold rule on ``pref``); NaN
                                        when the task has none (a file task scored by a reward model alone)
    rm_scores          (B,)             the learned reward model's standardised score; only with reward.model
    costs              (B,)             the task's cost, the constraint signal of safe_ppo; only when the
                                        task has a cost
    baseline_scores    (B,)             remax only: the score of the greedy response to the same prompt,
                                        shared by every sample of the group
  from inference, before any update of this step:
    old_logprobs       (B, Tr)          log-probs of the response tokens under the actor before this
                                        update: PPO's anchor and the decoupled loss's proximal policy
    ref_logprobs       (B, Tr)          the same tokens under the frozen reference (SFT) model: the KL anchor
    values             (B, Tr)          reward critic's value of the state before each token (ppo, safe_ppo)
    cost_values        (B, Tr)          safe_ppo's cost critic, the same for the cost
  from the advantage stage (``recipes.compute_advantages``):
    advantages         (B, Tr)          per-token advantage the policy loss weights (sequence-level estimators
                                        broadcast theirs over the response; 0 where response_mask is 0)
    returns            (B, Tr)          GAE value targets for the reward critic (ppo, safe_ppo)
    cost_returns       (B, Tr)          GAE value targets for the cost critic (safe_ppo)

Metadata lists (length B):
    uid             int     unique id of the sample within its step
    group_id        int     the prompt it answers; samples of one prompt share it (GRPO/RLOO groups)
    prompt          str     prompt text
    response        str     decoded response text (no eos)
    finish_reason   str     "stop" (eos or a stop token) or "length" (hit model.max_response_len)
    policy_version  int     weight version of the policy that generated it (the step it was synced at)
    task_prompt     Prompt  the task's ``Prompt`` object (reference answer, task metadata), set by the
                            trainer for the reward worker and the remax baseline
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from fuseflow.policy.microbatch import group_by_length


@dataclass
class Batch:
    """Tensors sharing dimension 0 (``tensors``) plus per-sample lists (``meta``).

    Every field the trainer stores, with its shape and meaning, is listed in this
    module's docstring. ``batch["advantages"]`` reads a tensor, ``batch.meta["uid"]`` a list.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()} | {k: len(v) for k, v in self.meta.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self.tensors and value.shape[0] != len(self):
            raise ValueError(f"field {key!r} has batch size {value.shape[0]}, batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """The samples at ``indices``, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        il = idx.tolist()
        return Batch({k: v[idx.to(v.device)] for k, v in self.tensors.items()},
                     {k: [v[i] for i in il] for k, v in self.meta.items()})

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` samples (the last may be smaller)."""
        n = len(self)
        return [self.select(range(i, min(i + size, n))) for i in range(0, n, size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack batches with the same fields; widths must already agree (see ``pad_to``)."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        keys = batches[0].tensors.keys()
        return Batch({k: torch.cat([b.tensors[k] for b in batches]) for k in keys},
                     {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta})

    def to(self, device: torch.device | str) -> Batch:
        """A new ``Batch`` with every tensor on ``device`` (one already there is the same object, not a copy);
        the ``meta`` lists are shared, not copied."""
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta))


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, left: bool, width: int | None = None,
                  dtype: torch.dtype = torch.long) -> torch.Tensor:
    """(B, width) tensor of ``seqs`` padded on the left or right with ``pad_id`` (``dtype``: long ids by
    default; float for per-token values such as log-probs).

    One tensor of all the values and one masked write, not a write per row: for 256 rows of 5-70 ids,
    0.9-1.1 ms against 3.4-3.6 ms row by row (2-core machine), which the controller pays per field of
    every micro-batch.

    >>> pad_sequences([[1, 2], [3]], 0, left=True)
    tensor([[1, 2],
            [0, 3]])
    """
    return _padded(seqs, pad_id, left, width, dtype)[0]


def _padded(seqs: Sequence[Sequence[int]], pad_id: int, left: bool, width: int | None = None,
            dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """``pad_sequences``' tensor and the (B, width) bool mask of its real positions."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    longest = int(lengths.max()) if len(seqs) else 0
    width = longest if width is None else width
    if longest > width:
        i = int((lengths > width).nonzero()[0])
        raise ValueError(f"sequence {i} has {len(seqs[i])} tokens, more than the width {width}")
    out = torch.full((len(seqs), width), pad_id, dtype=dtype)
    mask = length_mask(lengths, width, left)
    if longest:  # a boolean-mask write fills row by row, left to right: each row's values in order
        out[mask] = torch.tensor(list(chain.from_iterable(seqs)), dtype=dtype)
    return out, mask


def length_mask(lengths: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    """(B, width) bool, True on the real positions of rows of ``lengths`` padded on the left or right.

    >>> length_mask(torch.tensor([2, 0, 1]), 2, left=True)
    tensor([[ True,  True],
            [False, False],
            [False,  True]])
    """
    cols = torch.arange(width)
    return cols >= width - lengths[:, None] if left else cols < lengths[:, None]


def prompt_response(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                    pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, response_mask)`` in the batch layout: prompts left-padded, then
    responses right-padded; the masks long, 1 on real tokens.

    >>> prompt_response([[5], [6, 7]], [[8, 9], [1]], 0)[0]
    tensor([[0, 5, 8, 9],
            [6, 7, 1, 0]])
    """
    prompt, p_mask = _padded(prompt_ids, pad_id, left=True)
    response, r_mask = _padded(response_ids, pad_id, left=False)
    r_mask = r_mask.long()
    return torch.cat([prompt, response], 1), torch.cat([p_mask.long(), r_mask], 1), r_mask


def unpad(row: torch.Tensor, mask: torch.Tensor) -> list:
    """The entries of one row where ``mask`` is set, as a python list."""
    return row[mask.bool()].tolist()


# ------------------------------------------------------- length-sorted, trimmed micro-batches
# Padding is most of the cost on long-tailed tasks (about 3.8x the real tokens on `sort`); these
# live in the data layer so the roles (workers) can use them without importing the scheduler.
PROMPT_FIELDS = ("input_ids", "attention_mask")  # (B, Tp+Tr): prompt columns first, then response columns


def trim_padding(batch: Batch) -> Batch:
    """The batch without its all-padding columns: prompt columns on the left, response columns on the right.

    The layout is kept (prompt left-padded to the new ``Tp``, response right-padded to the new
    ``Tr``), so response token ``j`` still sits at column ``Tp + j``; masked columns carry no
    attention weight and positions come from the mask, so model outputs are unchanged.
    Every ``(B, Tr)`` field is cut to the new ``Tr``; ``(B,)`` fields are kept.
    """
    mask = batch["attention_mask"]  # (B, Tp+Tr)
    tr = batch["response_mask"].shape[1]
    tp = mask.shape[1] - tr
    prompt_real = mask[:, :tp].sum(-1)  # (B,)
    resp_real = mask[:, tp:].sum(-1)  # (B,)
    new_tp = int(prompt_real.max()) if len(batch) else 0
    new_tr = max(int(resp_real.max()) if len(batch) else 0, 1)  # keep one response column so shapes stay valid
    cols = torch.cat([torch.arange(tp - new_tp, tp), torch.arange(tp, tp + new_tr)])
    out = {}
    for k, v in batch.tensors.items():
        if k in PROMPT_FIELDS or (v.dim() >= 2 and v.shape[1] == tp + tr):
            out[k] = v[:, cols]
        elif v.dim() >= 2 and v.shape[1] == tr:
            out[k] = v[:, :new_tr]
        else:
            out[k] = v
    return Batch(out, {k: list(v) for k, v in batch.meta.items()})


def length_sorted_chunks(batch: Batch, budget: int) -> list[list[int]]:
    """Row indices of ``batch`` sorted by length and cut so each group fits ``budget`` padded tokens.

    A group's cost is rows x (longest prompt + longest response) in it; a sample larger than
    the budget forms its own. For inference, and for micro-batches within one training
    mini-batch (PPO's shuffle picks the mini-batch; its rows' order inside does not matter).
    """
    mask = batch["attention_mask"]  # (B, Tp+Tr)
    tr = batch["response_mask"].shape[1]
    prompt_len = mask[:, : mask.shape[1] - tr].sum(-1).tolist()
    resp_len = mask[:, mask.shape[1] - tr:].sum(-1).tolist()
    return group_by_length(prompt_len, resp_len, budget)


def pad_rows(rows: Sequence[torch.Tensor], width: int, fill: float = 0.0) -> torch.Tensor:
    """(len(rows), width) tensor whose row i is ``rows[i]`` (1-D, at most ``width`` long), right-padded:
    ``scatter_rows`` with one row per part in order, in one call (a step's 256 rows: ~5x faster).

    >>> pad_rows([torch.tensor([1.0, 2.0]), torch.tensor([5.0])], 3)
    tensor([[1., 2., 0.],
            [5., 0., 0.]])
    """
    out = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=fill)
    if out.shape[1] > width:
        raise ValueError(f"a row is {out.shape[1]} long, more than the target width {width}")
    return torch.nn.functional.pad(out, (0, width - out.shape[1]), value=fill)


def scatter_rows(parts: Sequence[tuple[Sequence[int], torch.Tensor]], rows: int, width: int,
                 fill: float = 0.0) -> torch.Tensor:
    """(rows, width) tensor with each part's (n, w <= width) rows written at its indices, right-padded.

    >>> scatter_rows([([1], torch.tensor([[5.0]])), ([0], torch.tensor([[1.0, 2.0]]))], 2, 3)
    tensor([[1., 2., 0.],
            [5., 0., 0.]])
    """
    if not parts:
        return torch.full((rows, width), fill)
    first = parts[0][1]
    out = torch.full((rows, width), fill, dtype=first.dtype, device=first.device)
    for idx, values in parts:
        if values.shape[1] > width:
            raise ValueError(f"a part is {values.shape[1]} wide, more than the target width {width}")
        out[torch.as_tensor(list(idx), dtype=torch.long), : values.shape[1]] = values
    return out
