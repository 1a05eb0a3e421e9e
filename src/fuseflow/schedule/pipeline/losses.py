"""The role workers' losses as the pipeline's last stages compute them (picklable factories).

`ActorLoss` / `CriticLoss` are handed to the stage processes with each step (`PipelineTrainer.step`
`losses=`); called there with the step's micro-batches they return the stage-output -> loss map,
normalised by all micro-batches' token and sequence counts (exact accumulation), which also keeps
each micro-batch's metrics in `records`. Light imports: the stage processes unpickle this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from torch import Tensor

from fuseflow.algorithms import aggregation_counts, get_policy_loss, value_loss
from fuseflow.workers.common import response_logprobs, response_slice
from fuseflow.workers.losses import actor_loss


class _Recorder:
    """A LossFn that keeps each micro-batch's metrics (the last stage sends them back)."""

    def __init__(self):
        self.records: list[dict[str, float]] = []


@dataclass
class ActorLoss:
    """The actor's loss in a stage process: `actor_loss` on the logits of the last stage."""

    algo: Any  # AlgorithmConfig
    kl_coef: float
    temperature: float
    norm_len: int

    def __call__(self, micro_batches: Sequence[Mapping[str, Tensor]]):
        n_tok = sum(aggregation_counts(mb["response_mask"])[0] for mb in micro_batches)
        n_seq = sum(aggregation_counts(mb["response_mask"])[1] for mb in micro_batches)
        policy_loss, spec = get_policy_loss(self.algo.policy_loss), self

        class Loss(_Recorder):
            def __call__(self, logits: Tensor, mb: Mapping[str, Tensor]) -> Tensor:
                # response_logprobs takes a model; hand it the logits the stage computed.
                logp, entropy = response_logprobs(lambda *a, **k: SimpleNamespace(logits=logits), mb,
                                                  spec.temperature, with_entropy=True)
                loss, metrics = actor_loss(policy_loss, spec.algo, logp, entropy, mb, spec.kl_coef, n_tok, n_seq,
                                           spec.norm_len)
                self.records.append(metrics)
                return loss

        return Loss()


@dataclass
class CriticLoss:
    """The critic's clipped value loss in a stage process (as `CriticWorker.update`)."""

    algo: Any
    norm_len: int

    def __call__(self, micro_batches: Sequence[Mapping[str, Tensor]]):
        n_tok = sum(aggregation_counts(mb["response_mask"])[0] for mb in micro_batches)
        n_seq = sum(aggregation_counts(mb["response_mask"])[1] for mb in micro_batches)
        spec = self

        class Loss(_Recorder):
            def __call__(self, values: Tensor, mb: Mapping[str, Tensor]) -> Tensor:
                v = values[:, response_slice(mb)].float()  # (B, Tr)
                loss, m = value_loss(v, mb["values"], mb["returns"], mb["response_mask"], spec.algo.value_clip,
                                     spec.algo.loss_agg, n_tok, n_seq, spec.norm_len)
                share = float(mb["response_mask"].sum() / n_tok)
                self.records.append({"critic/loss": float(loss.detach()),
                                     "critic/vf_clip_frac": float(m["vf_clip_frac"]) * share})
                return loss

        return Loss()
