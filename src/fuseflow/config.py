"""One typed config tree for every fuseflow command.

The tree is built once from a YAML preset shipped in the package plus dotted
``key=value`` overrides, validated by pydantic, and frozen: nothing mutates it
during a run. Errors become one line that names the field, the value given and
what is allowed (``ConfigError``), which the CLI prints before exiting with 2.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from fuseflow.config_checks import check_all
from fuseflow.config_dist import (
    ActorScale,
    CriticScale,
    PlacementConfig,
    PoolConfig,
    RayConfig,
    RoleScale,
    ScheduleConfig,
)
from fuseflow.config_tree import ConfigError, Section, parse_override, read_config_file, set_path


class TaskConfig(Section):
    name: Literal["arith", "safe_arith", "sort", "pref", "file", "reasoning_gym"] = "arith"
    seed: int = 1234  # data generation seed, separate from the training seed
    train_size: int = Field(20000, gt=0)
    eval_size: int = Field(500, gt=0)
    # arith: numbers have 1..max_digits digits; a careless demonstrator ignores carries
    # in a fraction of the SFT demonstrations (imperfect demonstrations leave RL room).
    max_digits: int = Field(3, ge=1, le=9)
    demo_error_rate: float = Field(0.6, ge=0.0, le=1.0)
    # safe_arith: an answer that contains this digit costs 1 (the safe_ppo constraint).
    forbidden_digit: int = Field(7, ge=0, le=9)
    # sort: list lengths are long-tailed (see fuseflow.tasks.sort).
    max_items: int = Field(32, ge=2, le=64)
    # file: user data with a `prompt` column (and optional `answer`, `response`).
    path: str | None = None
    eval_path: str | None = None
    reward_fn: str | None = None  # "package.module:function" or "path/to/file.py:function"
    cost_fn: str | None = None  # file: optional cost(prompt, response, answer) -> float, for safe_ppo
    success_threshold: float = 1.0  # a response with reward >= this counts as correct
    # reasoning_gym: a dataset of the reasoning-gym package (pip install reasoning-gym) and its settings
    # (difficulty etc.), passed to reasoning_gym.create_dataset as they are; see fuseflow.tasks.reasoning_gym.
    dataset: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    instruction: str = ""  # reasoning_gym: appended to every question, e.g. " Answer with the number only."
    # Prompts through the tokenizer's chat template (one user turn): null = when the tokenizer has one.
    chat_template: bool | None = None

    @model_validator(mode="after")
    def _file_needs_paths(self) -> TaskConfig:
        # task.reward_fn may be left out when reward.model gives the reward (checked in Config).
        if self.name == "file" and not self.path:
            raise ValueError("task.name=file needs task.path=FILE.jsonl|.parquet (and task.reward_fn=module:function "
                             "unless reward.model=DIR gives the reward)")
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError("task.name=reasoning_gym needs task.dataset=NAME (e.g. basic_arithmetic, chain_sum), "
                             "with settings in task.config={...}")
        if self.name != "reasoning_gym" and (self.dataset or self.config or self.instruction):
            raise ValueError(f"task.dataset, task.config and task.instruction are read by task.name=reasoning_gym "
                             f"only (got task.name={self.name})")
        return self


class LoraSection(Section):
    """LoRA on the policy (peft's conventions); only the adapters train, the reference is the frozen base."""

    enabled: bool = False
    rank: int = 8
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    @model_validator(mode="after")
    def _shape(self) -> LoraSection:
        if self.rank <= 0:
            raise ValueError(f"rank={self.rank} must be a positive integer (the adapters' inner dimension, "
                             "e.g. 8 or 16); turn LoRA off with model.lora.enabled=false")
        if self.enabled:
            from fuseflow.models.lora import targetable_names, unmatched_targets

            if not self.targets:
                raise ValueError("targets is empty; name the modules to adapt, e.g. [q_proj, v_proj]")
            bad = unmatched_targets(self.targets)
            if bad:
                raise ValueError(f"targets: {bad[0]!r} matches no module of the decoder; choose from "
                                 f"{', '.join(targetable_names())}")
        return self


class ModelSection(Section):
    size: Literal["tiny", "small"] = "tiny"
    # Start from a pretrained model instead of a size preset: a Hugging Face directory, a .gguf file
    # (converted once into cache_dir/gguf) or a named model (smollm2-135m); see fuseflow.models.source.
    path: str | None = None
    # A Hugging Face tokenizer directory; default: model.path's own tokenizer, else a built char-level one.
    tokenizer: str | None = None
    max_prompt_len: int = Field(64, gt=0)
    max_response_len: int = Field(16, gt=0)
    lora: LoraSection = LoraSection()


class SFTConfig(Section):
    enabled: bool = True
    max_steps: int = Field(4000, gt=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(100, ge=0)
    eval_every: int = Field(100, gt=0)
    patience: int = Field(6, gt=0)  # evals without held-out improvement before stopping
    eval_size: int = Field(500, gt=0)


ALGORITHMS = ("ppo", "grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "dapo", "safe_ppo")
# Estimators that credit a whole response (B,): they need groups, and KL can only be a loss term.

# What each algorithm changes from the field defaults, applied only to keys the user did not set,
# so `algorithm.name=dapo` alone gives DAPO and `algorithm.clip_high=0.3` still wins. The resolved
# values show in `fuseflow config show` and in each run's config.yaml.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "ppo": {"kl_in_reward": True},
    "dr_grpo": {"loss_agg": "seq-mean-token-sum-norm"},
    "reinforce_pp": {"kl_in_reward": True},
    "dapo": {"clip_high": 0.28, "dynamic_sampling": True, "overlong_buffer": 4, "kl_coef": 0.0},
    "safe_ppo": {"kl_in_reward": True},
}


class AlgorithmConfig(Section):
    name: Literal["ppo", "grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "dapo", "safe_ppo"] = "grpo"
    group_size: int = Field(8, gt=0)  # samples per prompt
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    clip_low: float = Field(0.2, gt=0.0, lt=1.0)
    clip_high: float = Field(0.2, gt=0.0)
    value_clip: float = Field(0.2, gt=0.0)
    kl_coef: float = Field(0.01, ge=0.0)
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    kl_in_reward: bool = False  # True: penalty folded into token rewards (PPO style); False: loss term
    # Adaptive KL (Ziegler et al. 2019): None keeps kl_coef fixed; a value steers the per-token KL to the
    # reference toward it, moving the coefficient by at most 20% per kl_horizon samples.
    kl_target: float | None = Field(None, gt=0.0)
    kl_horizon: int = Field(10000, gt=0)
    # Policy loss by registry name: ppo (clip against old_logprobs) or decoupled (clip against old_logprobs
    # as the proximal policy, tokens weighted by min(pi_old / pi_behaviour, is_cap); null means no cap).
    policy_loss: Literal["ppo", "decoupled"] = "ppo"
    is_cap: float | None = Field(2.0, gt=0.0)
    # Train/rollout mismatch correction (policy_loss=ppo): tis weighs each token by
    # min(pi_old / pi_behaviour, rollout_is_cap), pi_old from the trainer and pi_behaviour from the
    # rollout engine (they differ when the rollout runs vLLM, or bf16 against an fp32 trainer).
    rollout_is: Literal["none", "tis"] = "none"
    rollout_is_cap: float = Field(2.0, gt=0.0)
    # Where old_logprobs come from. recompute: a forward of the actor over the finished samples (verl's
    # default; any rollout backend). rollout: the log-probs the engine sampled with (behavior_logprobs),
    # saving that forward. They are the same numbers up to float rounding only where the engine decodes
    # with the trainer's own weights and arithmetic, and the samples are of the current policy:
    # rollout.backend=engine, a synchronous mode, fp32 (bf16 decoding is what rollout_is corrects).
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    norm_by_std: bool = True
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    # reinforce_pp: subtract the group-mean score before the return-to-go (reinforce_pp_baseline);
    # false gives plain REINFORCE++ (batch whitening only).
    group_baseline: bool = True
    # dapo: drop groups whose scores are all equal (zero advantage) and draw more prompts, at most
    # max_extra_draws more rounds; a batch still short after that is topped up with dropped groups.
    dynamic_sampling: bool = False
    max_extra_draws: int = Field(4, ge=0)
    # dapo: soft length penalty rising linearly from 0 to -overlong_penalty over the last
    # overlong_buffer tokens before model.max_response_len (0 disables it).
    overlong_buffer: int = Field(0, ge=0)
    overlong_penalty: float = Field(1.0, ge=0.0)
    # safe_ppo: Lagrange multiplier on the cost, lambda <- max(0, lambda + lambda_lr * (mean cost - cost_limit)).
    cost_limit: float = 0.05
    lambda_init: float = Field(1.0, ge=0.0)
    lambda_lr: float = Field(0.5, ge=0.0)

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            data = {**ALGORITHM_DEFAULTS.get(data["name"], {}), **data}
        return data


class RolloutConfig(Section):
    # engine (default): continuous batching with a paged KV cache and shared prefixes
    # (fuseflow.rollout.engine); sampler: the foundation's static-batch sampler; hf: plain
    # transformers `generate` (for comparison); vllm: vLLM's LLMEngine (docs/vllm.md; `make vllm` on CPU).
    backend: Literal["sampler", "engine", "hf", "vllm"] = "engine"
    # vllm: the rollout's dtype (auto: the model's); bf16 against an fp32 trainer is what rollout_is=tis corrects.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    weight_bucket_mb: float = Field(64.0, gt=0.0)  # vllm: weight sync pushes whole layers in buckets of about this
    max_num_seqs: int = Field(64, gt=0)  # engine: sequence slots
    kv_budget_tokens: int = Field(16384, gt=0)  # engine: KV cache budget in tokens
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 disables top-k
    # 2: pipelined generation (Pipe-RLHF): the actor split over 2 stage processes with 2 batches in flight,
    # samples token-identical to the engine's (schedule/pipeline/generate.py); 1: the backend above.
    pipeline_stages: int = Field(1, ge=1, le=2)


class TrainerConfig(Section):
    steps: int = Field(60, gt=0)
    prompts_per_step: int = Field(32, gt=0)
    mini_batch_size: int = Field(128, gt=0)  # samples per optimizer step
    micro_batch_size: int = Field(128, gt=0)  # samples per forward/backward (gradient accumulation)
    epochs: int = Field(1, gt=0)
    # RL steps must be far smaller than SFT's: Adam's first updates move every weight by about lr,
    # and at 1e-3 one step of the tiny policy shifted every log-prob by ~6 nats and collapsed it.
    lr: float = Field(3e-4, gt=0)
    critic_lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(5, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)
    # The actor's training forward keeps only each decoder layer's input and recomputes the layer in the
    # backward pass: much less activation memory for about one more forward pass of compute.
    activation_checkpointing: bool = False
    # Fix glibc's mmap threshold at 128 KiB (fuseflow.memory) so a step's freed activations leave the
    # resident set: on SmolLM2's LoRA step a 36% lower peak, but every large tensor then costs fresh
    # zeroed pages (about 40% more CPU time on that step), so it is off unless memory is the limit.
    release_freed_memory: bool = False
    save_every: int = Field(20, gt=0)
    eval_every: int = Field(20, gt=0)
    eval_size: int = Field(500, gt=0)
    # Checkpoints kept on disk: the last K plus the best by held-out accuracy; None keeps all. Old ones
    # are deleted only after the new one is complete.
    keep_checkpoints: int | None = Field(None, ge=1)
    # Automatic restarts when a worker process dies or a collective times out: tear the worker groups
    # down, start them again, reload the last checkpoint and go on. None: 0 on backend=local (a dead
    # in-process worker is the controller itself), 3 on backend=ray.
    max_restarts: int | None = Field(None, ge=0)
    # Wall-clock budget of the whole run in minutes (None: no limit). The run stops early, with its final
    # held-out evaluation and checkpoint, after the step past which one more step plus that evaluation
    # would not fit; the steps it would have run stay in trainer.steps.
    time_limit_minutes: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _batches_divide(self) -> TrainerConfig:
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"trainer.micro_batch_size={self.micro_batch_size} must divide "
                f"trainer.mini_batch_size={self.mini_batch_size}"
            )
        return self


class RewardConfig(Section):
    # A directory written by `fuseflow train-rm`: its Bradley-Terry score (standardised on its training
    # responses) becomes the reward, times model_weight, plus fn_weight times the task's reward function.
    model: str | None = None
    model_weight: float = 1.0
    fn_weight: float = 1.0  # default: 1.0 without a reward model, 0.0 with one (the task fn is then only logged)
    batch_size: int = Field(64, gt=0)  # samples per reward-model forward
    # Reward workers each scoring call is split over (backend=ray; each loads its own reward model).
    # Stays 1 when actor.dp grows: a reward function alone is cheap and gains nothing from more processes.
    dp: int = Field(1, ge=1)
    # The user's reward/cost function: seconds one call may take before the run stops naming it, and
    # processes to run it in (0: in this process; N: a pool of N spawned processes, so a function that
    # hangs or crashes its interpreter neither blocks nor kills the run).
    timeout_s: float = Field(30.0, gt=0)
    workers: int = Field(0, ge=0)
    # True: task.reward_fn names a batch function score_batch(prompts, responses, answers) -> list[float]
    # (as TRL's reward functions are written); null: batch when the function's name ends in "_batch".
    batch: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _fn_weight_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("model") and "fn_weight" not in data:
            data = {**data, "fn_weight": 0.0}
        return data


class RewardModelTrainConfig(Section):
    """`fuseflow train-rm`: a Bradley-Terry reward model on preference pairs."""

    data: str | None = None  # .jsonl/.parquet with prompt, chosen, rejected; None: synthetic pairs from task.name=pref
    eval_data: str | None = None  # held-out pairs; default: a stable ~eval_frac split of `data` by prompt hash
    eval_frac: float = Field(0.1, gt=0.0, lt=1.0)
    synthetic_pairs: int = Field(6000, gt=0)  # training pairs drawn from the synthetic task
    # Backbone to start from: "sft" (the config's SFT warm-start model, trained and cached if needed, as
    # RLHF recipes do), "random" (a fresh model.size backbone) or a causal-LM directory.
    init: str = "sft"
    steps: int = Field(1500, gt=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    eval_every: int = Field(100, gt=0)


class Config(Section):
    preset: str = "default"
    seed: int = 0
    device: str = "auto"
    output: str | None = None  # run directory; default runs/<preset>-<timestamp>
    cache_dir: str = "~/.cache/fuseflow"
    task: TaskConfig = TaskConfig()
    model: ModelSection = ModelSection()
    sft: SFTConfig = SFTConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    reward: RewardConfig = RewardConfig()
    rm: RewardModelTrainConfig = RewardModelTrainConfig()
    # Where the roles run. Split placement on Ray, for example: backend=ray actor.dp=2 critic.dp=2
    # placement.critic=critic (the critic gets a pool of its own); README "Scaling out" has the YAML.
    backend: Literal["local", "ray"] = "local"
    ray: RayConfig = RayConfig()
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    placement: PlacementConfig = PlacementConfig()
    actor: ActorScale = ActorScale()
    critic: CriticScale = CriticScale()
    reference: RoleScale = RoleScale()
    schedule: ScheduleConfig = ScheduleConfig()

    @model_validator(mode="before")
    @classmethod
    def _async_loss_default(cls, data: Any) -> Any:
        # Async samples come from an older policy: the decoupled loss corrects for it, so it is the
        # default there (applied only when algorithm.policy_loss was not set).
        if isinstance(data, dict) and "async" in str((data.get("schedule") or {}).get("mode", "")):
            algo = data.get("algorithm") or {}
            if isinstance(algo, dict) and "policy_loss" not in algo:
                data = {**data, "algorithm": {**algo, "policy_loss": "decoupled"}}
        return data

    @model_validator(mode="after")
    def _cross_section_checks(self) -> Config:
        check_all(self)  # fuseflow/config_checks.py
        return self

    def role_dp(self) -> dict[str, int]:
        """Data-parallel size of every role (reference and critic follow actor.dp unless set; reward.dp does not)."""
        a = self.actor.dp
        out = {"actor": a, "reference": self.reference.dp or a, "critic": self.critic.dp or a,
               "reward": self.reward.dp}
        if self.placement.rollout is not None:  # one replica process per rollout worker
            out["rollout"] = self.schedule.rollout_workers
        return out

    def resolved_placement(self):
        """The pools and role placement this config asks for (``fuseflow.controller.placement.Placement``)."""
        from fuseflow.controller.placement import resolve_placement

        placement = {r: p for r, p in self.placement.model_dump().items() if p is not None}
        return resolve_placement(self.pools, placement, self.role_dp())

    def to_yaml(self) -> str:
        """The resolved config as YAML, in field order: what a run saves as ``config.yaml`` and ``fuseflow config show`` prints."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def digest(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none), e.g. to key the SFT cache.

        ``model.lora`` is left out: it shapes only RL, so a LoRA run reuses the full-model SFT cache."""
        data = self.model_dump(mode="json", exclude={"model": {"lora"}})
        if sections:
            data = {k: data[k] for k in sections}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def preset_names() -> list[str]:
    """Names of the presets shipped in ``fuseflow.presets`` (``fuseflow train --preset NAME``), sorted."""
    return sorted(p.name[:-5] for p in resources.files("fuseflow.presets").iterdir() if p.name.endswith(".yaml"))


def _read_preset(name: str) -> dict[str, Any]:
    if name not in preset_names():
        raise ConfigError(f"preset: unknown preset {name!r}; choose one of: {', '.join(preset_names())}")
    text = resources.files("fuseflow.presets").joinpath(f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


def _format_error(err: ValidationError, tree: dict[str, Any]) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        section = _lookup_model(first["loc"][:-1])
        allowed = ", ".join(section.model_fields) if section else ""
        return f"{loc}: unknown key; allowed keys here: {allowed}"
    msg = first["msg"]
    if first["type"].startswith("value_error") or not loc:
        msg = msg.removeprefix("Value error, ")
        if not loc or msg.startswith((f"{loc}.", f"{loc}=")):  # the message names its keys itself
            return msg
        return f"{loc}: {msg}"
    return f"{loc}: invalid value {first.get('input')!r}: {msg}"


def _lookup_model(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    parts = list(loc)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        ann = getattr(field, "annotation", None)
        if get_origin(ann) is dict and parts:  # e.g. pools.<name>: the next part is a key, not a field
            ann = get_args(ann)[1]
            parts.pop(0)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def load_config(preset: str = "default", overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Build the validated, frozen config from a preset (or a saved tree) plus overrides.

    >>> load_config("default", ["trainer.steps=5"]).trainer.steps
    5
    """
    tree = dict(base) if base is not None else _read_preset(preset)
    tree.setdefault("preset", preset)
    for item in overrides or []:
        path, value = parse_override(item)
        set_path(tree, path, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err, tree)) from None


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> Config:
    """The config a run directory was started with, plus overrides (for --resume)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; pass a run directory made by `fuseflow train`")
    tree = read_config_file(path, f"--resume {run_dir}: {path.name}")
    return load_config(tree.get("preset", "default"), overrides, base=tree)
