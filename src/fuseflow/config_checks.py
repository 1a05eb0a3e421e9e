"""Checks across sections of the config tree: what one key allows depends on another.

Each function raises ``ValueError`` with one line naming the keys, the values given and the fix;
``Config`` runs them once, after its sections have validated (``Config._cross_section_checks``),
and ``load_config`` turns the error into a ``ConfigError``. Checks of one section (a field's range,
a section's own shape) stay beside their fields in ``config.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fuseflow.config import Config

# Advantage estimators that credit whole responses (no per-token KL in the reward).
SEQUENCE_LEVEL = ("grpo", "dr_grpo", "rloo", "remax", "dapo")


def check_all(cfg: Config) -> None:
    """Every cross-section check, in the order a user meets them (schedule, placement, pipeline, batch)."""
    schedule_fits(cfg)
    old_logprobs_fit(cfg)
    placement_fits(cfg)
    pipeline_fits(cfg)
    batch_fits(cfg)


def schedule_fits(cfg: Config) -> None:
    """schedule.mode against the backend, the rollout backend and the policy loss it needs."""
    s = cfg.schedule
    what = f"schedule.mode={s.mode}" + (f" with schedule.rollout_workers={s.rollout_workers}"
                                        if s.mode == "sequential" else "")
    if cfg.backend != "local" and cfg.placement.rollout is not None:
        rollout_pool_fits(cfg, what)
    if s.mode == "sequential" and s.rollout_workers == 1:
        return
    if cfg.backend != "local":
        rollout_pool_fits(cfg, what)
    if cfg.rollout.backend not in ("engine", "vllm"):
        raise ValueError(f"{what} streams and migrates samples with the rollout engine; set "
                         f"rollout.backend=engine or vllm (got {cfg.rollout.backend})")
    if s.asynchronous and cfg.algorithm.policy_loss != "decoupled":
        raise ValueError(f"schedule.mode={s.mode} trains on samples of an older policy; it needs "
                         f"algorithm.policy_loss=decoupled (got {cfg.algorithm.policy_loss})")


def old_logprobs_fit(cfg: Config) -> None:
    """algorithm.old_logprobs=rollout: the engine's sampling log-probs are the current policy's only when the
    engine decodes with the trainer's weights and the samples are of this step's weights."""
    a = cfg.algorithm
    if a.old_logprobs != "rollout":
        return
    if cfg.rollout.backend != "engine":
        raise ValueError(f"algorithm.old_logprobs=rollout takes the log-probs fuseflow's engine sampled with; "
                         f"rollout.backend={cfg.rollout.backend} is not it: set rollout.backend=engine or "
                         "algorithm.old_logprobs=recompute")
    if cfg.schedule.asynchronous:
        raise ValueError(f"algorithm.old_logprobs=rollout: schedule.mode={cfg.schedule.mode} trains on samples of an "
                         "older policy, whose sampling log-probs are not the current policy's; use "
                         "algorithm.old_logprobs=recompute or a synchronous mode")
    if a.rollout_is != "none":
        raise ValueError(f"algorithm.rollout_is={a.rollout_is} weighs tokens by pi_old / pi_behaviour, which is 1 "
                         "when algorithm.old_logprobs=rollout; drop one of them")


def rollout_pool_fits(cfg: Config, what: str) -> None:
    """backend=ray: the mode's rollout replicas need a pool of their own with a bundle each."""
    s, name = cfg.schedule, cfg.placement.rollout
    if name is None:
        why = ("releases rollout replica processes as they run out of work" if s.elastic
               else "runs its rollout replicas as processes")
        raise ValueError(f"{what} {why} on backend=ray and needs a rollout pool: set placement.rollout=NAME "
                         f"(e.g. placement.rollout=rollout, one bundle per replica), or use "
                         "schedule.mode=sequential schedule.rollout_workers=1")
    shared = [r for r, p in cfg.placement.model_dump().items() if p == name and r != "rollout"]
    if shared:
        raise ValueError(f"placement.rollout={name} shares pool {name!r} with {shared[0]}, whose processes cannot "
                         f"host rollout replicas (each is a process of its own on a bundle of its own); place "
                         f"them on a pool of their own, e.g. placement.rollout=rollout")
    pool = cfg.pools.get(name)
    if pool is not None and pool.workers_per_node is not None:
        bundles = pool.nodes * pool.workers_per_node
        if s.rollout_workers > bundles:
            raise ValueError(f"schedule.rollout_workers={s.rollout_workers} is larger than pool {name!r}'s "
                             f"{bundles} bundles (pools.{name}.nodes x workers_per_node); allowed: at most "
                             f"{bundles}, or raise pools.{name}.workers_per_node")


def placement_fits(cfg: Config) -> None:
    """Data-parallel sizes against the backend, the mini-batch and the pools (``resolved_placement``)."""
    dp = cfg.role_dp()
    if cfg.backend == "local":
        wide = [f"{r}.dp={k}" for r, k in dp.items() if k > 1 and r != "rollout"]  # rollout: threads here
        if wide:
            raise ValueError(f"{wide[0]} needs backend=ray: the local backend runs every role once, in this process")
        return
    for role in ("actor", "critic"):
        if cfg.trainer.mini_batch_size % dp[role]:
            raise ValueError(f"{role}.dp={dp[role]} must divide trainer.mini_batch_size={cfg.trainer.mini_batch_size} "
                             "(every rank takes an equal share of each mini-batch)")
    cfg.resolved_placement()


def pipeline_fits(cfg: Config) -> None:
    """actor.pp / critic.pp: what the pipeline-parallel training step supports (docs/pipeline.md)."""
    a, c, name = cfg.actor, cfg.critic, cfg.algorithm.name
    if a.pp_split is not None and len(a.pp_split) != a.pp:
        raise ValueError(f"actor.pp_split={a.pp_split} needs actor.pp={a.pp} layer counts (one per stage)")
    if a.pp_split is not None and min(a.pp_split) < 1:
        raise ValueError(f"actor.pp_split={a.pp_split}: every stage needs at least one layer")
    if cfg.rollout.pipeline_stages > 1:
        pipelined_rollout_fits(cfg)
    if a.pp == 1 and c.pp == 1:
        return
    what = f"actor.pp={a.pp}" if a.pp > 1 else f"critic.pp={c.pp}"
    if name != "ppo" and c.pp > 1:
        raise ValueError(f"critic.pp={c.pp}: algorithm.name={name} " + (
            "has two critics, which the pipeline does not run; use critic.pp=1 actor.pp=1" if name == "safe_ppo"
            else "has no critic; drop critic.pp"))
    if name == "ppo" and c.pp != a.pp:
        raise ValueError(f"actor.pp={a.pp} critic.pp={c.pp}: PPO trains actor and critic on the same stage "
                         f"processes (a fused schedule); set both to {max(a.pp, c.pp)}")
    if cfg.backend != "local":
        raise ValueError(f"{what} runs its stage processes on this machine (torch.distributed, gloo); it needs "
                         f"backend=local (got backend={cfg.backend}); on Ray they would be a pool's workers, "
                         "not wired yet")
    if cfg.model.lora.enabled:
        raise ValueError(f"{what} trains full weights; model.lora.enabled=true is not supported with it "
                         "(set actor.pp=1)")
    if cfg.schedule.mode != "sequential":
        raise ValueError(f"{what} is wired for schedule.mode=sequential only (got {cfg.schedule.mode})")


def pipelined_rollout_fits(cfg: Config) -> None:
    """rollout.pipeline_stages > 1: local backend, fuseflow's engine, full weights, one sequential worker."""
    what = f"rollout.pipeline_stages={cfg.rollout.pipeline_stages}"
    if cfg.backend != "local":
        raise ValueError(f"{what} runs its stage processes on this machine; it needs backend=local "
                         f"(got backend={cfg.backend})")
    if cfg.rollout.backend != "engine":
        raise ValueError(f"{what} replaces the engine with pipelined stages that sample as the engine does; "
                         f"set rollout.backend=engine (got {cfg.rollout.backend})")
    if cfg.model.lora.enabled:
        raise ValueError(f"{what} loads full weights into its stages; model.lora.enabled=true is not "
                         "supported with it")
    if cfg.schedule.mode != "sequential" or cfg.schedule.rollout_workers != 1:
        raise ValueError(f"{what} is wired for schedule.mode=sequential with schedule.rollout_workers=1 "
                         f"(got {cfg.schedule.mode}, {cfg.schedule.rollout_workers} workers)")


def batch_fits(cfg: Config) -> None:
    """Algorithm, batch sizes, task and reward settings that only make sense together."""
    a = cfg.algorithm
    # Checked before the batch arithmetic: with one sample per prompt the group baseline is the sample
    # itself, every advantage is 0 and nothing is learned, whatever the batch sizes.
    needs_groups = a.name in ("grpo", "dr_grpo", "rloo", "dapo") or a.dynamic_sampling or (
        a.name == "reinforce_pp" and a.group_baseline)
    if needs_groups and a.group_size < 2:
        raise ValueError(f"algorithm.group_size={a.group_size} leaves {a.name}'s group baseline meaningless "
                         "(each sample is its own group, so every advantage is 0); set algorithm.group_size>=2"
                         + (", or algorithm.group_baseline=false" if a.name == "reinforce_pp" else
                            ", or use algorithm.name=ppo or remax, which need no groups"))
    samples = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
    if samples % cfg.trainer.mini_batch_size:
        raise ValueError(
            f"trainer.mini_batch_size={cfg.trainer.mini_batch_size} must divide the samples per step "
            f"(trainer.prompts_per_step * algorithm.group_size = {samples})"
        )
    if a.kl_in_reward and a.name in SEQUENCE_LEVEL:
        raise ValueError(f"algorithm.kl_in_reward=true needs token-level advantages (ppo, safe_ppo, reinforce_pp); "
                         f"{a.name} credits whole responses, so set algorithm.kl_in_reward=false "
                         "(the KL becomes a loss term)")
    if a.overlong_buffer >= cfg.model.max_response_len:
        raise ValueError(f"algorithm.overlong_buffer={a.overlong_buffer} must be smaller than "
                         f"model.max_response_len={cfg.model.max_response_len}")
    if a.name == "safe_ppo" and not (cfg.task.name == "safe_arith" or cfg.task.cost_fn):
        raise ValueError(f"algorithm.name=safe_ppo needs a cost signal, and task.name={cfg.task.name} has none; "
                         "use task.name=safe_arith, or task.name=file with task.cost_fn=module:function")
    if cfg.task.cost_fn and cfg.task.name != "file":
        raise ValueError(f"task.cost_fn is read by task.name=file only (got task.name={cfg.task.name})")
    if cfg.task.reward_fn and cfg.task.name != "file":
        raise ValueError(f"task.reward_fn is read by task.name=file only; task.name={cfg.task.name} scores with "
                         "its own built-in reward. Drop task.reward_fn, or use task.name=file task.path=DATA")
    if cfg.task.name == "file" and not cfg.task.reward_fn:
        if not cfg.reward.model:
            raise ValueError("task.name=file needs task.reward_fn=module:function, or reward.model=DIR "
                             "(a reward model from `fuseflow train-rm`) to give the reward")
        if cfg.reward.fn_weight:
            raise ValueError(f"reward.fn_weight={cfg.reward.fn_weight} weighs the task's reward function, "
                             "but task.reward_fn is not set; set task.reward_fn or reward.fn_weight=0")
    if cfg.model.lora.enabled and cfg.rollout.backend == "hf":
        raise ValueError("model.lora.enabled=true runs the adapters in fuseflow's own rollout; rollout.backend=hf "
                         "keeps a second full copy without them: use rollout.backend=engine (or sampler)")
    rollout_backend_fits(cfg)
    if a.rollout_is == "tis" and a.policy_loss == "decoupled":
        raise ValueError("algorithm.rollout_is=tis weighs tokens by min(pi_old / pi_behaviour, cap), which "
                         "algorithm.policy_loss=decoupled already does (algorithm.is_cap); drop rollout_is "
                         "or use policy_loss=ppo")
    if a.kl_target is not None and a.kl_coef == 0:
        raise ValueError(f"algorithm.kl_target={a.kl_target} adapts algorithm.kl_coef, which is 0 and would "
                         "stay 0; set algorithm.kl_coef>0 as the starting value, or drop kl_target")


def rollout_backend_fits(cfg: Config) -> None:
    """rollout.backend=vllm: installed, sampling options it can score, no LoRA, a KV budget for one sample."""
    r = cfg.rollout
    if r.backend != "vllm":
        if r.dtype != "auto":
            raise ValueError(f"rollout.dtype={r.dtype} applies to rollout.backend=vllm only; the {r.backend} "
                             "backend decodes with the trainer's model (set device's dtype instead)")
        return
    from fuseflow.rollout.vllm_backend import INSTALL_HINT, vllm_available

    if not vllm_available():
        raise ValueError(INSTALL_HINT)
    if r.top_k > 0 or r.top_p < 1.0:
        raise ValueError(f"rollout.top_k={r.top_k} rollout.top_p={r.top_p}: with rollout.backend=vllm the "
                         "behaviour log-probs would be renormalised over the kept tokens; use top_k=0 top_p=1, "
                         "or rollout.backend=engine")
    if cfg.model.lora.enabled:
        raise ValueError("model.lora.enabled=true runs the adapters in fuseflow's own rollout; rollout.backend=vllm "
                         "gets full weights only: use rollout.backend=engine")
    longest = cfg.model.max_prompt_len + cfg.model.max_response_len
    if r.kv_budget_tokens < longest:  # found here, not by the first request in a replica process minutes later
        raise ValueError(f"rollout.kv_budget_tokens={r.kv_budget_tokens} cannot hold one sample of model.max_prompt_len"
                         f" + model.max_response_len = {longest} tokens (with rollout.backend=vllm it also caps each "
                         f"sequence); raise rollout.kv_budget_tokens to at least {longest}")
