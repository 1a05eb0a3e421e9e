"""`fuseflow bench trl`: GRPO on the long-tailed `sort` task in fuseflow and in TRL's `GRPOTrainer`.

Both sides start from the same SFT warm-start weights (our checkpoint directory loads in
transformers as ``LlamaForCausalLM``, with our char tokenizer as its HF tokenizer), see the
same prompts in the same order, and run the same GRPO step: ``prompts_per_step`` prompts x
``group_size`` samples, ``max_response_len`` new tokens at most, temperature 1.0, mini-batches
of ``mini_batch_size`` (so ``samples / mini_batch_size`` optimizer steps per RL step, each
needing the old log-probs), KL to the reference as a loss term with the same coefficient,
clip 0.2, CPU fp32, the same torch thread count.

Fair to TRL: its defaults everywhere except what must match (batch shape, lengths, sampling,
lr, KL coefficient), plus fp32 instead of its bf16 default (the comparison is CPU fp32),
gradient checkpointing off (its default is on; it trades compute for memory a model this
small does not need, and fuseflow does not use it), and logging, saving and evaluation off,
as they are in fuseflow's timed steps. Its generation is its default path (transformers
`generate` on the whole generation batch); TRL's vLLM path needs a GPU.

The two run interleaved in one process: a TRL callback runs one fuseflow step at each of
TRL's RL-step boundaries, and each side is timed only over its own steps, so bursts of load
from other processes hit both alike. The first step of each side is a warm-up and is left
out of the headline figures (it is reported). Wall-clock and process-CPU seconds are both
recorded; with one torch thread on a shared CPU, CPU time is the steadier measure.

Same cores on both sides: fuseflow with ``schedule.rollout_workers = N`` runs N worker threads
of ``threads`` intra-op threads each, so TRL's steps run with ``N x threads`` intra-op threads
(switched at each side's step boundary); a 1-thread TRL against N busy fuseflow cores would
measure the core count, not the framework.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fuseflow.config import Config, load_config

from . import cpu_name, write_result

# The benchmark's own settings on top of the `sort` preset. The SFT warm start is shortened
# (300 steps, cached after the first run) because only a policy that ends its responses
# where the task does is needed, so that lengths follow the task's long tail.
BENCH_OVERRIDES = ("sft.max_steps=300", "sft.eval_every=100", "sft.eval_size=100", "rollout.backend=engine")
# A seconds-scale configuration for tests.
QUICK_OVERRIDES = ("trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.mini_batch_size=8",
                   "trainer.micro_batch_size=8", "model.max_response_len=24", "task.max_items=6",
                   "sft.max_steps=40", "sft.eval_every=40", "sft.eval_size=16", "rollout.backend=engine")


# A pretrained chat model (``--model``): the `smollm` preset's task, batch, lengths and LoRA settings.
MODEL_OVERRIDES = ("rollout.backend=engine",)
QUICK_MODEL_OVERRIDES = ("trainer.prompts_per_step=2", "algorithm.group_size=4", "trainer.mini_batch_size=8",
                         "trainer.micro_batch_size=4", "model.max_response_len=8", "task.train_size=64",
                         "task.eval_size=8", "trainer.eval_size=8", "rollout.backend=engine")


def bench_config(overrides: list[str] | None = None, quick: bool = False, steps: int = 4,
                 model: str | None = None) -> Config:
    """The `sort` preset with the benchmark's settings, then the user's overrides.

    With ``model`` (a named model, GGUF file or HF directory) it is the `smollm` preset on that model
    instead: no SFT stage, chat-templated reasoning-gym prompts, LoRA as the preset sets it.
    """
    if model is not None:
        base = list(QUICK_MODEL_OVERRIDES if quick else MODEL_OVERRIDES)
        return load_config("smollm", [f"model.path={model}", *base, f"trainer.steps={steps}", *(overrides or [])])
    base = list(QUICK_OVERRIDES if quick else BENCH_OVERRIDES)
    return load_config("sort", [*base, f"trainer.steps={steps}", *(overrides or [])])


def _trl_prompts(ff, order: list[int]) -> tuple[list, Callable[[Any], str], Callable[[Any], str]]:
    """TRL's dataset prompts for fuseflow's prompt indices, and how to read a prompt's and a completion's text.

    A chat tokenizer gets conversational prompts (one user turn), which TRL renders with the same chat
    template (assistant header included) as fuseflow; TRL then hands completions back as messages.
    """
    from fuseflow.data.tokenizer import uses_chat_template

    texts = [ff.train_prompts[i].text for i in order]
    if uses_chat_template(ff.tokenizer):
        return ([[{"role": "user", "content": t}] for t in texts], lambda p: p[-1]["content"],
                lambda c: c[-1]["content"])
    return texts, lambda p: p, lambda c: c


class _Timer:
    """Wall and process-CPU seconds of consecutive steps."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._w = self._c = 0.0
        self._carry = (0.0, 0.0)  # time of work done early for the next step (wall, cpu)

    def start(self) -> None:
        self._w, self._c = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._w + self._carry[0])
        self.cpu.append(time.process_time() - self._c + self._carry[1])
        self._carry = (0.0, 0.0)

    def for_next_step(self, work: Callable[[], object]) -> None:
        """Run ``work`` now, between steps, and count its time in the next step's entry."""
        w, c = time.perf_counter(), time.process_time()
        work()
        self._carry = (self._carry[0] + time.perf_counter() - w, self._carry[1] + time.process_time() - c)


def _summary(timer: _Timer, samples_per_step: int, tokens: list[float], warmup: int) -> dict[str, Any]:
    """Headline figures over the steps after the warm-up (all steps when there are no others)."""
    w = warmup if len(timer.wall) > warmup else 0
    wall, cpu, tok = timer.wall[w:], timer.cpu[w:], tokens[w:]
    n = samples_per_step * len(wall)
    return {"samples_per_second": n / sum(wall), "samples_per_cpu_second": n / sum(cpu),
            "tokens_per_second": sum(tok) / sum(wall), "step_seconds_median": statistics.median(wall),
            "step_seconds": [round(x, 3) for x in timer.wall], "step_cpu_seconds": [round(x, 3) for x in timer.cpu],
            "response_tokens_per_step": [round(x, 1) for x in tokens], "timed_steps": len(wall),
            "response_length_mean": sum(tok) / n}


def run_trl_comparison(cfg: Config, threads: int = 1, work_dir: str | Path | None = None, log=print) -> dict:
    """Run GRPO for ``cfg.trainer.steps`` steps in fuseflow and in TRL, interleaved; return the figures.

    ``speedup_vs_trl`` is fuseflow samples/s over TRL samples/s (wall clock, after warm-up). Run files go
    to ``work_dir`` (kept) or a temporary directory (removed).
    """
    if cfg.algorithm.name != "grpo":  # checked first: a bad config is reported even without TRL installed
        raise ValueError(f"algorithm.name must be grpo for the TRL comparison, got {cfg.algorithm.name}")
    try:
        import datasets
        import trl
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    except ImportError as exc:
        raise ImportError(f"fuseflow bench trl needs TRL: pip install 'fuseflow[bench]' ({exc})") from exc
    from fuseflow.schedule.modes import update_threads
    from fuseflow.trainer import PromptStream, RLTrainer

    if cfg.trainer.steps < 1:
        raise ValueError(f"trainer.steps must be >= 1, got {cfg.trainer.steps}")
    torch.set_num_threads(threads)
    # The cores fuseflow's rollout workers use, capped at the machine's as `Strategy.train` caps them.
    trl_threads = update_threads(threads, cfg.schedule.rollout_workers)
    t, a, steps = cfg.trainer, cfg.algorithm, cfg.trainer.steps
    samples_per_step = t.prompts_per_step * a.group_size
    if work_dir is None:  # both runs' files are scratch: removed afterwards
        with tempfile.TemporaryDirectory(prefix="fuseflow-bench-trl-") as scratch:
            return run_trl_comparison(cfg, threads, scratch, log)
    tmp = Path(work_dir)
    log("fuseflow: setting up" + (" (SFT warm start, cached after the first run)" if cfg.sft.enabled else ""))
    ff = RLTrainer(cfg, tmp / "fuseflow", log=log)
    sft_dir = tmp / "fuseflow" / "reference"  # the SFT weights + tokenizer, an HF directory

    # TRL gets the prompts fuseflow will draw, in the same order (and does not shuffle them).
    order = PromptStream(len(ff.train_prompts), cfg.seed).take(steps * t.prompts_per_step)
    by_text = {ff.train_prompts[i].text: ff.train_prompts[i] for i in order}
    trl_prompts, prompt_text, completion_text = _trl_prompts(ff, order)
    data = datasets.Dataset.from_dict({"prompt": trl_prompts})

    trl_tokens: list[float] = []
    trl_rewards: list[float] = []
    trl_longest: list[int] = []  # a static generate batch runs until its longest sample is done

    def sort_reward(prompts, completions, completion_ids, **_):
        # Called once per generation batch (one RL step); completion ids include the eos, as fuseflow counts them.
        trl_tokens.append(float(sum(len(c) for c in completion_ids)))
        trl_longest.append(max(len(c) for c in completion_ids))
        scores = [ff.task.score(by_text[prompt_text(p)], completion_text(c))
                  for p, c in zip(prompts, completions, strict=True)]
        trl_rewards.append(sum(scores) / len(scores))
        return scores

    tokenizer = AutoTokenizer.from_pretrained(str(sft_dir))
    ours_ids = ff.train_ids[order[0]]  # fuseflow's prompt ids (chat-templated when the tokenizer has a template)
    if isinstance(trl_prompts[0], list):
        theirs_ids = tokenizer.apply_chat_template(trl_prompts[0], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    else:
        theirs_ids = tokenizer(trl_prompts[0])["input_ids"]
    if list(theirs_ids) != list(ours_ids):
        raise ValueError("TRL would tokenize the prompts differently from fuseflow (special tokens or template)")
    model = AutoModelForCausalLM.from_pretrained(str(sft_dir), dtype=torch.float32)
    peft_config = None
    if cfg.model.lora.enabled:  # the same adapters: peft's LoraConfig of the same rank, alpha, dropout, targets
        from fuseflow.models.lora import LoraSpec

        lo = cfg.model.lora
        peft_config = LoraSpec(lo.rank, lo.alpha, lo.dropout, tuple(lo.targets)).peft_config()
    mini = t.mini_batch_size
    # transformers 5 renamed gradient_checkpointing (TRL's default: on) to activation_checkpointing.
    names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    no_ckpt = {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False}
    args = trl.GRPOConfig(
        output_dir=str(tmp / "trl"), seed=cfg.seed, use_cpu=True, bf16=False, fp16=False, **no_ckpt, report_to="none", logging_strategy="no", save_strategy="no",
        eval_strategy="no", disable_tqdm=True, shuffle_dataset=False,
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=mini // t.micro_batch_size,
        steps_per_generation=(samples_per_step // mini) * (mini // t.micro_batch_size),
        num_generations=a.group_size, max_completion_length=cfg.model.max_response_len,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        learning_rate=t.lr, beta=a.kl_coef, epsilon=a.clip_low, epsilon_high=a.clip_high,
        max_grad_norm=t.grad_clip, max_steps=steps * (samples_per_step // mini), num_iterations=t.epochs,
    )
    ff_timer, trl_timer = _Timer(), _Timer()
    ff_tokens: list[float] = []
    ff_rewards: list[float] = []
    ff_longest: list[int] = []
    optim_per_rl_step = samples_per_step // mini

    class Interleave(TrainerCallback):
        """Times TRL per RL step and runs one fuseflow step at each boundary (outside TRL's timing)."""

        def on_train_begin(self, *_, **__):
            torch.set_num_threads(trl_threads)
            trl_timer.start()

        def on_step_end(self, _args, state, *_, **__):
            if state.global_step % optim_per_rl_step:
                return
            trl_timer.stop()
            rl_step = state.global_step // optim_per_rl_step
            torch.set_num_threads(threads)
            ff_timer.start()
            m = ff.step(rl_step)
            ff_timer.stop()
            # async: the next step's generation is fuseflow's time, not TRL's, and that step's, as in `bench fusion`
            ff_timer.for_next_step(ff.strategy.finish_prefetch)
            torch.set_num_threads(trl_threads)
            ff_tokens.append(m["rollout/response_length_mean"] * m["rollout/num_samples"])
            ff_rewards.append(m["reward/mean"])
            ff_longest.append(int(m["rollout/response_length_max"]))
            log(f"step {rl_step}: TRL {trl_timer.wall[-1]:.1f}s, fuseflow {ff_timer.wall[-1]:.1f}s "
                f"(reward {m['reward/mean']:.3f})")
            trl_timer.start()

    trainer = trl.GRPOTrainer(model=model, reward_funcs=sort_reward, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Interleave()], peft_config=peft_config)
    log("TRL GRPOTrainer: training (fuseflow steps interleaved)")
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    ff.close()
    if len(trl_tokens) != steps or len(ff_tokens) != steps:
        raise RuntimeError(f"expected {steps} RL steps per side, got TRL {len(trl_tokens)}, fuseflow {len(ff_tokens)}")
    ours = _summary(ff_timer, samples_per_step, ff_tokens, 1) | {"reward_per_step": ff_rewards,
                                                                  "response_length_max_per_step": ff_longest}
    theirs = _summary(trl_timer, samples_per_step, trl_tokens, 1) | {"reward_per_step": trl_rewards,
                                                                     "response_length_max_per_step": trl_longest}
    return {
        "benchmark": f"grpo_{cfg.task.name}_vs_trl", "device": "cpu", "dtype": "float32", "torch_threads": threads,
        "trl_torch_threads": trl_threads,
        "cpu": cpu_name(), "torch": torch.__version__, "trl_version": trl.__version__,
        "settings": {"task": cfg.task.name, "model": cfg.model.path or cfg.model.size, "steps": steps,
                     "warmup_steps_excluded": 1, "lora": cfg.model.lora.model_dump() if cfg.model.lora.enabled else None,
                     "trl_prompts": "conversational (chat template)" if isinstance(trl_prompts[0], list) else "text",
                     "prompts_per_step": t.prompts_per_step, "group_size": a.group_size,
                     "samples_per_step": samples_per_step, "mini_batch_size": mini,
                     "micro_batch_size": t.micro_batch_size, "max_prompt_len": cfg.model.max_prompt_len,
                     "max_response_len": cfg.model.max_response_len, "temperature": cfg.rollout.temperature,
                     "kl_coef": a.kl_coef, "lr": t.lr, "fuseflow_mode": cfg.schedule.mode,
                     "fuseflow_old_logprobs": a.old_logprobs,
                     "fuseflow_rollout_workers": cfg.schedule.rollout_workers,
                     "fuseflow_rollout_backend": cfg.rollout.backend,
                     "fuseflow_shared_prefix": cfg.schedule.shared_prefix, "sft_steps_max": cfg.sft.max_steps,
                     "trl_generation": "transformers generate (TRL default)", "trl_loss_type": args.loss_type,
                     "trl_gradient_checkpointing": bool(args.gradient_checkpointing)},
        "fuseflow": ours, "trl": theirs,
        "speedup_vs_trl": ours["samples_per_second"] / theirs["samples_per_second"],
        "speedup_vs_trl_cpu_time": ours["samples_per_cpu_second"] / theirs["samples_per_cpu_second"],
    }


def register(bench_app) -> None:
    """Add ``fuseflow bench trl`` to the ``bench`` Typer app."""
    import typer

    @bench_app.command("trl")
    def bench_trl(overrides: list[str] = typer.Argument(None, help="Dotted overrides on the bench config."),
                  out: Path = typer.Option(None, "--out", "-o", help="Write the JSON here."),
                  steps: int = typer.Option(4, "--steps", help="RL steps per side (the first is a warm-up)."),
                  threads: int = typer.Option(1, "--threads", help="torch threads (both sides)."),
                  quick: bool = typer.Option(False, "--quick", help="A seconds-scale run (tests, smoke checks)."),
                  model: str = typer.Option(None, "--model", help="A pretrained model (e.g. smollm2-135m, a .gguf "
                                            "file, an HF directory): the `smollm` preset's task, batch and LoRA "
                                            "on it instead of `sort`.")) -> None:
        """GRPO on `sort` (or a pretrained model with --model): fuseflow vs TRL's GRPOTrainer, same weights, batch
        and lengths; samples/s ratio."""
        from fuseflow.config import ConfigError
        from fuseflow.console import console, fail

        try:
            if steps < 1 or threads < 1:
                raise ValueError(f"--steps and --threads must be >= 1, got {steps} and {threads}")
            result = run_trl_comparison(bench_config(overrides, quick, steps, model), threads, log=console.print)
        except (ConfigError, ValueError, ImportError, FileNotFoundError) as e:
            fail(str(e))
        f, r = result["fuseflow"], result["trl"]
        console.print(f"fuseflow {f['samples_per_second']:.1f} samples/s, TRL {r['samples_per_second']:.1f} "
                      f"samples/s: speedup_vs_trl {result['speedup_vs_trl']:.2f}x "
                      f"(CPU-time ratio {result['speedup_vs_trl_cpu_time']:.2f}x)", soft_wrap=True)
        write_result(out, result)
