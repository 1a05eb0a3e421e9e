"""Held-out evaluation as the workers run it, next to the model they hold.

The trainer used to evaluate on its own copy of the policy; with worker groups the
policy lives in the actor's processes, so the actor (rank 0, on its unsharded weights)
runs greedy accuracy and sampling, the reference samples the SFT baseline, and the
reward worker scores preferences with its reward model. Same measures, same seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuseflow.evaluate import evaluate
from fuseflow.heldout import cost_rate, greedy_responses, preference_eval, sampled_responses
from fuseflow.tasks import Prompt, Task

EVAL_SAMPLES = 4  # sampled responses per held-out prompt when judging a reward-model run


@dataclass
class HeldOut:
    """The held-out prompts and decoding settings of one run (``trainer.eval_size`` prompts)."""

    task: Task
    tokenizer: object
    prompts: list[Prompt]
    max_prompt_len: int
    max_response_len: int
    temperature: float
    seed: int

    @classmethod
    def from_config(cls, cfg, task: Task, tokenizer) -> HeldOut:
        """The held-out set a run's config asks for: the task's first ``trainer.eval_size`` held-out prompts, the
        model's lengths and the rollout temperature, seeded apart from training (``seed + 99``)."""
        return cls(task, tokenizer, task.eval_prompts()[: cfg.trainer.eval_size], cfg.model.max_prompt_len,
                   cfg.model.max_response_len, cfg.rollout.temperature, cfg.seed + 99)

    def greedy(self, model) -> dict[str, float]:
        """Greedy accuracy, reward and length; the cost rate too when the task has a cost."""
        ev = evaluate(model, self.tokenizer, self.task, self.prompts, self.max_prompt_len, self.max_response_len)
        if self.task.has_cost:
            greedy = greedy_responses(model, self.tokenizer, self.prompts, self.max_prompt_len,
                                      self.max_response_len)
            ev["cost"] = cost_rate(self.task, self.prompts, greedy)
        return ev

    def sampled(self, model) -> list[str]:
        """``EVAL_SAMPLES`` seeded responses per prompt, paired across models by seed."""
        return sampled_responses(model, self.tokenizer, self.prompts, self.max_prompt_len, self.max_response_len,
                                 self.temperature, EVAL_SAMPLES, seed=self.seed)

    def preference(self, responses: list[str], sft_responses: list[str], reward_model) -> dict[str, float]:
        """Preference metrics of the policy's held-out responses against the SFT model's (``preference_eval``)."""
        prompts = [p for p in self.prompts for _ in range(EVAL_SAMPLES)]
        return preference_eval(self.task, prompts, responses, sft_responses, reward_model)
