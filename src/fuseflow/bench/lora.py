"""``fuseflow bench lora``: peak memory of training with LoRA vs full fine-tuning, and the engine on adapters.

Memory. Each variant (``full``, ``lora``) runs in a fresh process (multiprocessing spawn), so each
peak is its own: the actor and the reference are built by the run's own builders
(``build_actor`` / ``build_reference``, engine included) from one model directory, then ``steps``
RL updates run on one synthetic batch (old and reference log-probs, then ``ActorWorker.update``).
The figure is the process's peak resident set (``ru_maxrss``), the same batch and settings in both;
the resident set after imports, before any model is built, is recorded beside it. Full
fine-tuning holds gradients and Adam's two moments of every weight plus a reference copy; LoRA
holds them for the adapters only and its reference is a view of the frozen base.

Engine. Greedy decoding of the same prompts, in tokens/s, on the base model, on the adapted
model (the engine adds each adapter's low-rank term on the fly) and on a merged copy (W + s B A:
what merging would run, at the price of a second full copy of the weights).

The default model is a random one of SmolLM2-135M's shape (30 layers, hidden 576, 49,152-token
vocabulary, tied embeddings); ``--model DIR`` takes a Hugging Face directory instead.
"""

from __future__ import annotations

import multiprocessing
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import cpu_name, write_result

# SmolLM2-135M's config.json (the shape; the weights here are random).
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192)


def _rss_mb() -> float:
    """Resident set of this process now, MB (from /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KB


def _train_variant(model_dir: str, lora: bool, rows: int, prompt_len: int, response_len: int, steps: int,
                   threads: int, overrides: list[str], group_size: int = 1) -> dict:
    """Child process: build actor + reference for one variant, run ``steps`` updates, report memory."""
    torch.set_num_threads(threads)
    from fuseflow.config import load_config
    from fuseflow.controller.worker import DistInfo
    from fuseflow.data.batch import Batch
    from fuseflow.memory import bound_heap_retention
    from fuseflow.tasks import make_task
    from fuseflow.workers.build import RoleContext, build_actor, build_reference

    after_imports = _rss_mb()
    cfg = load_config("default", ["task.train_size=64", "task.eval_size=8", f"trainer.mini_batch_size={rows}",
                                  "algorithm.kl_in_reward=false", "algorithm.kl_coef=0.05", "trainer.epochs=1",
                                  f"model.lora.enabled={str(lora).lower()}", *overrides])
    if cfg.trainer.release_freed_memory:  # the process set up as `fuseflow train` sets up its own
        bound_heap_retention()
    ctx = RoleContext(cfg, Path(model_dir), None, make_task(cfg.task))
    actor, ref = build_actor(ctx, DistInfo()), build_reference(ctx, DistInfo())
    built = _rss_mb()
    vocab = actor.plain.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(response_len // 2, response_len + 1, (rows,), generator=g)
    rmask = (torch.arange(response_len) < lengths[:, None]).float()  # (B, Tr)
    # Rows i, i+1, ... of one group share their prompt (GRPO samples group_size responses per prompt).
    prompts = torch.randint(0, vocab, (-(-rows // group_size), prompt_len), generator=g)
    ids = torch.cat([prompts[torch.arange(rows) // group_size],
                     torch.randint(0, vocab, (rows, response_len), generator=g)], 1)
    batch = Batch({"input_ids": ids,
                   "attention_mask": torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), rmask.long()], 1),
                   "response_mask": rmask, "advantages": torch.randn(rows, response_len, generator=g) * rmask},
                  {"uid": list(range(rows)), "group_id": [i // group_size for i in range(rows)]})
    seconds = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch["old_logprobs"] = batch["behavior_logprobs"] = actor.compute_logprobs(batch)
        batch["ref_logprobs"] = ref.compute_logprobs(batch)
        actor.update(batch, cfg.trainer.lr, 0.05, seed=step)
        seconds.append(time.perf_counter() - t0)
    opt_state = actor.optimizer.state_dict()["state"]
    trainable = [p for group in actor.optimizer.param_groups for p in group["params"]]
    return {"peak_rss_mb": _peak_mb(), "rss_after_imports_mb": after_imports, "rss_after_build_mb": built,
            "trainable_params": sum(p.numel() for p in trainable),
            "total_params": actor.plain.num_parameters(),
            "optimizer_state_mb": sum(v.numel() * v.element_size() for st in opt_state.values()
                                      for v in st.values() if torch.is_tensor(v)) / 2**20,
            "reference_shares_base": _shares(ref.model, actor.plain),
            "step_seconds": statistics.median(seconds)}


def _shares(ref: torch.nn.Module, actor: torch.nn.Module) -> bool:
    ptrs = {p.data_ptr() for p in actor.parameters()}
    return all(p.data_ptr() in ptrs for p in ref.parameters())


def _engine_tps(model, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    from fuseflow.rollout.base import RolloutRequest, SamplingParams
    from fuseflow.rollout.engine import Engine, EngineConfig

    params = SamplingParams(greedy=True, max_new_tokens=new_tokens)
    engine = Engine(model, EngineConfig(max_num_seqs=len(prompts)))
    rates = []
    for r in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        n = sum(len(s.response_ids) for s in engine.generate(
            RolloutRequest(f"{r}-{i}", p, params) for i, p in enumerate(prompts)))
        if r:
            rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def engine_speed(model_dir: Path, rank: int, prompts: int, new_tokens: int, repeats: int) -> dict:
    """Greedy tokens/s of the base, the adapted (on-the-fly) and the merged model; B random so adapters act."""
    from fuseflow.models import CausalLM
    from fuseflow.models.lora import LoraSpec, apply_lora, base_view, lora_layers, merged_model

    model = apply_lora(CausalLM.from_pretrained(model_dir), LoraSpec(rank, 2.0 * rank), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            b = layer.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    vocab = model.config.vocab_size
    ids = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(prompts)]
    out = {name: _engine_tps(m, ids, new_tokens, repeats)
           for name, m in (("base", base_view(model)), ("lora_on_the_fly", model), ("merged_copy", merged_model(model)))}
    return {"tokens_per_second": out, "lora_vs_base": out["lora_on_the_fly"] / out["base"],
            "lora_vs_merged": out["lora_on_the_fly"] / out["merged_copy"]}


def run_lora_bench(model: str | None = None, rows: int = 16, prompt_len: int = 64, response_len: int = 64,
                   steps: int = 2, threads: int = 2, overrides: list[str] | None = None, rank: int = 8,
                   engine_prompts: int = 16, engine_tokens: int = 32, repeats: int = 3, log=print,
                   micro_batch: int | None = None, group_size: int = 1) -> dict:
    """Both memory variants (each in its own process), then the engine comparison; the figures as a dict.

    ``rows`` sequences make one mini-batch (one optimizer step per update), cut into micro-batches of
    ``micro_batch`` rows (default: all of them) for gradient accumulation. Rows come in groups of
    ``group_size`` that share a prompt, as GRPO's samples of one prompt do (1: every prompt distinct).
    """
    from fuseflow.models import CausalLM, ModelConfig

    micro_batch = micro_batch or rows
    if steps < 1 or rows < 1 or micro_batch < 1 or rows % micro_batch or group_size < 1:
        raise ValueError(f"steps, rows and the group size must be >= 1 and the micro-batch must divide rows, got "
                         f"steps={steps}, rows={rows}, micro-batch={micro_batch}, group size={group_size}")
    with tempfile.TemporaryDirectory(prefix="fuseflow-bench-lora-") as tmp:
        if model is None:
            model_dir = Path(tmp) / "model"
            cfg = ModelConfig.preset("small", **SMOLLM2_135M)
            CausalLM.from_config(cfg, seed=0).save_pretrained(model_dir)
        else:  # an HF directory, a .gguf file or a named model (smollm2-135m), as model.path takes them
            from fuseflow.config import load_config
            from fuseflow.models.source import resolve_model_path

            model_dir = resolve_model_path(model, load_config("default").cache_dir, log)
            if not (model_dir / "config.json").is_file():
                raise FileNotFoundError(f"--model {model}: no config.json there; pass a Hugging Face model directory")
        lora_args = [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}",
                     f"trainer.micro_batch_size={micro_batch}",
                     *(overrides or [])]
        variants = {}
        spawn = multiprocessing.get_context("spawn")
        for name in ("full", "lora"):
            log(f"training memory: {name} fine-tuning in a fresh process...")
            with spawn.Pool(1) as pool:
                variants[name] = pool.apply(_train_variant, (str(model_dir), name == "lora", rows, prompt_len,
                                                             response_len, steps, threads, lora_args, group_size))
        log("engine: base vs adapted (on the fly) vs merged copy...")
        torch.set_num_threads(threads)
        engine = engine_speed(model_dir, rank, engine_prompts, engine_tokens, repeats)
    full, lora = variants["full"], variants["lora"]
    return {
        "machine": {"cpu": cpu_name(), "threads": threads, "torch": torch.__version__},
        "model": model or "random, SmolLM2-135M's shape",
        "settings": {"rows": rows, "prompt_len": prompt_len, "response_len": response_len, "steps": steps,
                     "micro_batch_size": micro_batch, "group_size": group_size, "rank": rank, "alpha": 2 * rank,
                     "targets": "q,k,v,o,gate,up,down", "overrides": overrides or []},
        "variants": variants,
        "peak_reduction": 1.0 - lora["peak_rss_mb"] / full["peak_rss_mb"],
        "peak_reduction_above_imports": 1.0 - (lora["peak_rss_mb"] - lora["rss_after_imports_mb"]) / (
            full["peak_rss_mb"] - full["rss_after_imports_mb"]),
        "engine": engine,
    }


def register(bench_app) -> None:
    """Add ``fuseflow bench lora`` to the ``bench`` Typer app."""
    import typer

    @bench_app.command("lora")
    def bench_lora(overrides: list[str] = typer.Argument(None, help="Dotted overrides for both variants."),
                   out: Path = typer.Option(None, "--out", "-o", help="Write the JSON here."),
                   model: str = typer.Option(None, "--model", help="A Hugging Face model directory, .gguf "
                                             "file or named model such as smollm2-135m (default: a random model of "
                                             "SmolLM2-135M's shape)."),
                   rows: int = typer.Option(16, "--rows", help="Sequences in the batch (one mini-batch)."),
                   micro_batch: int = typer.Option(None, "--micro-batch", help="Rows per forward/backward "
                                                   "(default: all rows)."),
                   prompt_len: int = typer.Option(64, "--prompt-len"),
                   group_size: int = typer.Option(1, "--group-size", help="Rows per prompt (GRPO's samples of one "
                                                  "prompt; 1: every prompt distinct)."),
                   response_len: int = typer.Option(64, "--response-len"),
                   steps: int = typer.Option(2, "--steps", help="RL updates per variant."),
                   rank: int = typer.Option(8, "--rank", help="LoRA rank (alpha = 2 * rank)."),
                   threads: int = typer.Option(2, "--threads", help="torch threads.")) -> None:
        """Peak memory of a training process, LoRA vs full fine-tuning, and engine speed on the adapters."""
        from fuseflow.config import ConfigError
        from fuseflow.console import console, fail

        try:
            r = run_lora_bench(model, rows, prompt_len, response_len, steps, threads, overrides, rank,
                               log=console.print, micro_batch=micro_batch, group_size=group_size)
        except (ConfigError, ValueError, FileNotFoundError) as e:
            fail(str(e))
        for name, v in r["variants"].items():
            console.print(f"{name:5s} peak RSS {v['peak_rss_mb']:.0f} MB (after imports {v['rss_after_imports_mb']:.0f}"
                          f" MB), trainable {v['trainable_params'] / 1e6:.2f}M of {v['total_params'] / 1e6:.1f}M, "
                          f"optimizer state {v['optimizer_state_mb']:.1f} MB, step {v['step_seconds']:.1f}s")
        console.print(f"LoRA peak is {100 * r['peak_reduction']:.1f}% lower "
                      f"({100 * r['peak_reduction_above_imports']:.1f}% above the imports' baseline)")
        t = r["engine"]["tokens_per_second"]
        console.print(f"engine tok/s: base {t['base']:.0f}, LoRA on the fly {t['lora_on_the_fly']:.0f}, "
                      f"merged copy {t['merged_copy']:.0f}")
        write_result(out, r)
