"""Builders: make one rank of a role from the config, inside the process that will run it.

``RLTrainer`` hands a ``WorkerGroup`` a builder (``functools.partial(build_actor, ctx)``)
instead of a model: on the ``local`` backend it runs here, on ``ray`` in each of the
pool's processes, so weights load where they are used and never cross a process
boundary. A trainable role with ``dp > 1`` is sharded with FSDP2 before its optimizer
is made; on resume the optimizer state (saved in the single-process layout) is sharded
the same way.

With ``model.lora.enabled`` the actor is the run's base model (``ref_dir``) with peft adapters
(``models.lora``), resumed from the adapter its checkpoint saved. It leaves a view of its frozen
base in this process (``_FROZEN_BASES``) for the reference built next on the same rank (colocated
roles share a process), so the reference is the same base tensors, not a second copy. A reference
placed in another process loads its own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from fuseflow.checkpoint import load_optimizer_state
from fuseflow.config import Config
from fuseflow.controller.worker import DistInfo
from fuseflow.models import CausalLM, ValueModel, resolve_device
from fuseflow.models.llama import set_activation_checkpointing
from fuseflow.models.lora import LoraSpec, apply_lora, base_view, load_adapter, lora_spec
from fuseflow.models.parallelize import load_full_optimizer_state, shard_fsdp
from fuseflow.models.source import run_tokenizer
from fuseflow.rollout.sampler import Sampler
from fuseflow.tasks import Task

from .actor import ActorWorker, ReferenceWorker
from .critic import CriticWorker
from .evaluation import HeldOut
from .reward import RewardWorker


@dataclass(frozen=True)
class RoleContext:
    """Everything a builder needs; picklable, so Ray can ship it to the workers.

    ref_dir:      the run's reference (SFT) model directory, the start of every model
    ckpt:         checkpoint directory to resume from, or None
    task:         the run's task (its prompts, reward and cost functions)
    reward_model: an already loaded reward model (local backend); None loads ``reward.model``
    """

    cfg: Config
    ref_dir: Path
    ckpt: Path | None
    task: Task
    reward_model: object | None = None


def rollout_backend(cfg: Config, model: CausalLM, tokenizer):
    """The configured rollout backend over ``model``'s own weights (shared in-process, except hf)."""
    r = cfg.rollout
    if r.backend == "engine":
        from fuseflow.rollout.engine import Engine, EngineConfig

        return Engine(model, EngineConfig(max_num_seqs=r.max_num_seqs, kv_budget_tokens=r.kv_budget_tokens),
                      tokenizer=tokenizer)
    if r.backend == "vllm":
        from fuseflow.rollout.vllm_backend import VLLMBackend

        return VLLMBackend(model, dtype=r.dtype, max_num_seqs=r.max_num_seqs, kv_budget_tokens=r.kv_budget_tokens,
                           weight_bucket_mb=r.weight_bucket_mb)
    if r.backend == "hf":
        from fuseflow.rollout.hf_backend import HFBackend

        return HFBackend(model, pad_id=tokenizer.pad_token_id, batch_size=r.max_num_seqs)
    return Sampler(model, tokenizer.pad_token_id)


# (ref_dir, rank) -> the base view of the LoRA actor built in this process, for the reference role.
_FROZEN_BASES: dict[tuple[str, int], CausalLM] = {}


def engine_factory(cfg: Config):
    """How the local rollout pool makes a worker's engine over a model: None (fuseflow's engine) unless
    rollout.backend=vllm."""
    if cfg.rollout.backend != "vllm":
        return None
    return lambda model: rollout_backend(cfg, model, None)


def _shard(plain: torch.nn.Module, device: torch.device, dist: DistInfo) -> torch.nn.Module:
    """The model the optimizer trains: FSDP shards of a copy when dp > 1, else ``plain`` itself
    (also for a LoRA policy, which trains replicated: see ``workers.parallel``)."""
    if lora_spec(plain) is not None or not dist.distributed:
        return plain
    return shard_fsdp(copy.deepcopy(plain), device.type, dist.world_size)


def lora_spec_of(cfg: Config) -> LoraSpec | None:
    """The adapters ``model.lora`` asks for, or None when LoRA is off."""
    lo = cfg.model.lora
    return LoraSpec(lo.rank, lo.alpha, lo.dropout, tuple(lo.targets)) if lo.enabled else None


def _policy(ctx: RoleContext, device: torch.device, dist: DistInfo) -> CausalLM:
    """The actor's model: the checkpoint's (or the reference's) weights, or the base plus LoRA adapters."""
    spec = lora_spec_of(ctx.cfg)
    if spec is None:
        return CausalLM.from_pretrained(ctx.ckpt / "actor" if ctx.ckpt else ctx.ref_dir).to(device)
    model = apply_lora(CausalLM.from_pretrained(ctx.ref_dir).to(device), spec, seed=ctx.cfg.seed)
    if ctx.ckpt:
        load_adapter(model, ctx.ckpt / "actor")
    _FROZEN_BASES[(str(ctx.ref_dir), dist.rank)] = base_view(model)
    return model


def _load_optimizer(worker, ckpt: Path | None) -> None:
    if ckpt is None:
        return
    state = load_optimizer_state(ckpt / f"optim_{worker.role}")
    if worker.sharded:
        load_full_optimizer_state(worker.optimizer, state)
    else:
        worker.optimizer.load_state_dict(state)


def _batching(worker, cfg) -> None:
    """How ``worker`` cuts its forwards: padded tokens per micro-batch, shared prompts and the prompt
    cache (``schedule``)."""
    worker.token_budget = cfg.schedule.token_budget
    worker.share_prefix = cfg.schedule.shared_prefix
    worker.cache_prompts = cfg.schedule.prompt_cache


def build_actor(ctx: RoleContext, dist: DistInfo) -> ActorWorker:
    """The actor role on one rank: the policy (FSDP2-sharded when ``dp > 1`` on Ray, except a LoRA policy, which
    trains replicated), its rollout backend, tokenizer, held-out prompts and micro-batching."""
    cfg = ctx.cfg
    device, dtype = resolve_device(cfg.device)
    tokenizer = run_tokenizer(cfg)
    plain = _policy(ctx, device, dist)
    worker = ActorWorker(_shard(plain, device, dist), rollout_backend(cfg, plain, tokenizer), device, dtype,
                         cfg.algorithm, cfg.trainer, cfg.rollout.temperature, cfg.model.max_response_len, plain=plain)
    set_activation_checkpointing(worker.model, cfg.trainer.activation_checkpointing)
    worker.tokenizer, worker.heldout = tokenizer, HeldOut.from_config(cfg, ctx.task, tokenizer)
    _batching(worker, cfg)
    worker.base_path = ctx.ref_dir.resolve()
    _load_optimizer(worker, ctx.ckpt)
    return worker


def build_rollout_engine(ctx: RoleContext):
    """A rollout replica's engine (backend=ray), a scorer over the same model and one over the reference:
    its own copy of the policy, built as the actor's is (same checkpoint, same LoRA adapters), so the
    weight sync's parameter lists match. The scorers are the actor's log-prob code
    (``ReferenceWorker.compute_logprobs``): a replica with nothing to decode computes old log-probs with
    the first and reference log-probs with the second, over a copy of the frozen reference (the
    initial policy, loaded as ``build_reference`` loads it; never synced, since it never trains).

    With ``rollout.backend=vllm`` the engine is vLLM's, over that model's weights, started here (in
    the replica process, in-process mode): a model vLLM cannot load then fails the replica's start,
    and vLLM's start-up is paid while the controller builds the other roles."""
    from fuseflow.rollout.engine import Engine, EngineConfig

    cfg, r = ctx.cfg, ctx.cfg.rollout
    device, dtype = resolve_device(cfg.device)
    model = _policy(ctx, device, DistInfo()).eval().requires_grad_(False)
    _FROZEN_BASES.clear()  # no reference is built in a replica process
    if r.backend == "vllm":
        engine = rollout_backend(cfg, model, None)
        engine.start()
    else:
        engine = Engine(model, EngineConfig(max_num_seqs=r.max_num_seqs, kv_budget_tokens=r.kv_budget_tokens),
                        tokenizer=run_tokenizer(cfg))
    scorer = ReferenceWorker(model, device, dtype, r.temperature)
    _batching(scorer, cfg)
    ref = CausalLM.from_pretrained(ctx.ref_dir).to(device).eval().requires_grad_(False)
    ref_scorer = ReferenceWorker(ref, device, dtype, r.temperature)
    _batching(ref_scorer, cfg)
    return engine, scorer, ref_scorer


def build_reference(ctx: RoleContext, dist: DistInfo) -> ReferenceWorker:
    """The frozen reference role on one rank: the SFT model from ``ctx.ref_dir`` (with LoRA, the actor's own frozen
    base when it is on this rank), its held-out prompts and micro-batching."""
    cfg = ctx.cfg
    device, dtype = resolve_device(cfg.device)
    shared = _FROZEN_BASES.pop((str(ctx.ref_dir), dist.rank), None) if cfg.model.lora.enabled else None
    model = shared if shared is not None else CausalLM.from_pretrained(ctx.ref_dir).to(device)
    worker = ReferenceWorker(model, device, dtype, cfg.rollout.temperature)
    worker.heldout = HeldOut.from_config(cfg, ctx.task, run_tokenizer(cfg))
    _batching(worker, cfg)
    return worker


def build_critic(ctx: RoleContext, dist: DistInfo, name: str = "critic", prefix: str = "") -> CriticWorker:
    """The reward critic (``name="critic"``) or safe_ppo's cost critic (``"cost_critic"``, prefix ``cost_``)."""
    cfg = ctx.cfg
    device, dtype = resolve_device(cfg.device)
    plain = (ValueModel.from_pretrained(ctx.ckpt / name) if ctx.ckpt
             else ValueModel.from_causal_lm(CausalLM.from_pretrained(ctx.ref_dir))).to(device)
    worker = CriticWorker(_shard(plain, device, dist), device, dtype, cfg.algorithm, cfg.trainer,
                          cfg.model.max_response_len, prefix, name, plain=plain)
    _batching(worker, cfg)
    _load_optimizer(worker, ctx.ckpt)
    return worker


def build_reward(ctx: RoleContext, dist: DistInfo) -> RewardWorker:
    """The reward role on one rank: the task's reward (a user's function gets its timeout, process pool and
    batching here) and, with ``reward.model``, the learned reward model."""
    cfg = ctx.cfg
    rm = ctx.reward_model
    if rm is None and cfg.reward.model:
        from fuseflow.reward_model import RewardModel

        device, dtype = resolve_device(cfg.device)
        rm = RewardModel.load(cfg.reward.model, device, dtype, cfg.reward.batch_size)
    if hasattr(ctx.task, "configure_calls"):  # a user's reward/cost function: timeout, process pool, batching
        ctx.task.configure_calls(cfg.reward.timeout_s, cfg.reward.workers, cfg.reward.batch)
    worker = RewardWorker(ctx.task, rm, cfg.reward.fn_weight, cfg.reward.model_weight)
    worker.heldout = HeldOut.from_config(cfg, ctx.task, run_tokenizer(cfg))
    return worker
