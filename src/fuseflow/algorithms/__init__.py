"""RL advantage estimators, losses and KL tools as pure tensor functions.

Each estimator and policy loss is registered by name (see :mod:`.registry`), so the
config selects it with a string; ``docs/algorithms.md`` gives each formula.
Tensors are ``(B, T)`` over response tokens unless a docstring says otherwise.
"""

from fuseflow.algorithms.advantages import (
    dr_grpo,
    gae,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from fuseflow.algorithms.aggregation import AGG_MODES, aggregate, aggregation_counts
from fuseflow.algorithms.kl import KL_KINDS, AdaptiveKLController, FixedKLController, kl_penalty
from fuseflow.algorithms.losses import (
    decoupled_policy_loss,
    ppo_policy_loss,
    rollout_mismatch,
    truncated_is_weight,
    value_loss,
)
from fuseflow.algorithms.masked import masked_mean, masked_sum, masked_whiten
from fuseflow.algorithms.registry import (
    ADVANTAGES,
    POLICY_LOSSES,
    call_with_inputs,
    get_advantage,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "aggregation_counts",
    "call_with_inputs",
    "rollout_mismatch",
    "truncated_is_weight",
    "decoupled_policy_loss",
    "dr_grpo",
    "gae",
    "get_advantage",
    "get_policy_loss",
    "grpo",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "ppo_policy_loss",
    "register_advantage",
    "register_policy_loss",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "value_loss",
]
