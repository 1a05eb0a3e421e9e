"""Builders: make one rank of a role from the config, inside the process that will run it.

``RLTrainer`` hands a ``WorkerGroup`` a builder (``functools.partial(build_actor, ctx)``)
instead of a model: on the ``local`` backend it runs here, on ``ray`` in each of the
pool's processes, so weights load where they are used and never cross a process
boundary. A trainable role with ``dp > 1`` is sharded with FSDP2 before its optimizer
is made; on resume the optimizer state (saved in the single-process layout) is sharded
the same way.
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
    r, pad = cfg.rollout, tokenizer.pad_token_id
    if r.backend == "engine":
        from fuseflow.rollout.engine import Engine, EngineConfig

        return Engine(model, EngineConfig(max_num_seqs=r.max_num_seqs, kv_budget_tokens=r.kv_budget_tokens),
                      tokenizer=tokenizer)
    if r.backend == "hf":
        from fuseflow.rollout.hf_backend import HFBackend

        return HFBackend(model, pad_id=pad, batch_size=r.max_num_seqs)
    return Sampler(model, pad)


def _shard(plain: torch.nn.Module, device: torch.device, dist: DistInfo) -> torch.nn.Module:
    """The model the optimizer trains: FSDP shards of a copy when dp > 1, else ``plain`` itself."""
    return shard_fsdp(copy.deepcopy(plain), device.type, dist.world_size) if dist.distributed else plain


def _load_optimizer(worker, ckpt: Path | None) -> None:
    if ckpt is None:
        return
    state = load_optimizer_state(ckpt / f"optim_{worker.role}")
    if worker.sharded:
        load_full_optimizer_state(worker.optimizer, state)
    else:
        worker.optimizer.load_state_dict(state)


def build_actor(ctx: RoleContext, dist: DistInfo) -> ActorWorker:
    cfg = ctx.cfg
    device, dtype = resolve_device(cfg.device)
    tokenizer = run_tokenizer(cfg)
    plain = CausalLM.from_pretrained(ctx.ckpt / "actor" if ctx.ckpt else ctx.ref_dir).to(device)
    worker = ActorWorker(_shard(plain, device, dist), rollout_backend(cfg, plain, tokenizer), device, dtype,
                         cfg.algorithm, cfg.trainer, cfg.rollout.temperature, cfg.model.max_response_len, plain=plain)
    worker.tokenizer, worker.heldout = tokenizer, HeldOut.from_config(cfg, ctx.task, tokenizer)
    worker.token_budget = cfg.schedule.token_budget
    _load_optimizer(worker, ctx.ckpt)
    return worker


def build_reference(ctx: RoleContext, dist: DistInfo) -> ReferenceWorker:
    cfg = ctx.cfg
    device, dtype = resolve_device(cfg.device)
    worker = ReferenceWorker(CausalLM.from_pretrained(ctx.ref_dir).to(device), device, dtype,
                             cfg.rollout.temperature)
    worker.heldout = HeldOut.from_config(cfg, ctx.task, run_tokenizer(cfg))
    worker.token_budget = cfg.schedule.token_budget
    return worker


def build_critic(ctx: RoleContext, dist: DistInfo, name: str = "critic", prefix: str = "") -> CriticWorker:
    """The reward critic (``name="critic"``) or safe_ppo's cost critic (``"cost_critic"``, prefix ``cost_``)."""
    cfg = ctx.cfg
    device, dtype = resolve_device(cfg.device)
    plain = (ValueModel.from_pretrained(ctx.ckpt / name) if ctx.ckpt
             else ValueModel.from_causal_lm(CausalLM.from_pretrained(ctx.ref_dir))).to(device)
    worker = CriticWorker(_shard(plain, device, dist), device, dtype, cfg.algorithm, cfg.trainer,
                          cfg.model.max_response_len, prefix, name, plain=plain)
    worker.token_budget = cfg.schedule.token_budget
    _load_optimizer(worker, ctx.ckpt)
    return worker


def build_reward(ctx: RoleContext, dist: DistInfo) -> RewardWorker:
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
