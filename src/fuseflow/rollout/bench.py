"""`fuseflow bench rollout`: the engine against vLLM and plain transformers `generate`, in one process.

Both sides get the same weights, the same requests and the same number of generated tokens per
request (EOS is never a stop token and every request has its own target length, its
`max_new_tokens`). HF runs static left-padded batches of `slots` requests, each until its longest
request is done: that idle tail is the cost being measured. The engine runs with `slots` sequence
slots, twice: as configured by default, and with plain `F.linear` matmuls (`linear_kernel="torch"`,
the kernels HF runs on), which separates what scheduling and KV handling gain from what oneDNN's
matmuls gain (none for fp32 on an Intel CPU, where the default takes plain `F.linear` too:
`engine.runner.mkl_preferred`). The three sides run interleaved in one process (an engine step or an HF batch at a
time, always advancing the side least far along), so a burst of load from other processes hits all
of them alike; each repeat is a fresh interleaved run and the median per side is reported.
Wall-clock and process-CPU times are both recorded. With `--backends ...,vllm` vLLM's engine
(`rollout.vllm_backend`, started once before timing, prefix cache reset per repeat) is one more
side on the same weights and requests; `--dtype bfloat16` runs every side in bf16.

Workloads (full size; `--quick` divides request counts and the length cap by 4):
  uniform    64 requests, prompts of 16-128 tokens, every response 96 tokens
  long_tail  128 requests, prompts of 16-128 tokens, response lengths log-normal (median 24,
             sigma 1.1) clipped to [2, 256]: p99/p50 about 10
  groups     16 prompts of 200 tokens x 8 samples (GRPO groups), lengths as in long_tail
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from fuseflow.models import CausalLM, ModelConfig
from fuseflow.rollout.base import RolloutRequest, SamplingParams

WORKLOADS = ("uniform", "long_tail", "groups")
VOCAB = 4096  # a subword-sized vocabulary, so the LM head and sampling cost what they would in practice


def _prompt(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=gen).tolist()


def long_tail_lengths(n: int, median: int, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    """Log-normal response lengths exp(N(log median, sigma)) clipped to [lo, hi] (deterministic in seed)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    return [int(min(hi, max(lo, round(median * math.exp(sigma * float(x)))))) for x in z]


def make_workload(name: str, quick: bool, seed: int = 0) -> tuple[list[RolloutRequest], dict]:
    """Requests of one workload plus a description of its lengths (goes into the JSON)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 4 if quick else 1
    if name == "uniform":
        n, resp = 64 // scale, 96 // scale
        prompts = [_prompt(gen, int(torch.randint(16, 129, (1,), generator=gen))) for _ in range(n)]
        lengths, groups = [resp] * n, list(range(n))
    elif name == "long_tail":
        n = 128 // scale
        prompts = [_prompt(gen, int(torch.randint(16, 129, (1,), generator=gen))) for _ in range(n)]
        lengths, groups = long_tail_lengths(n, 24, 1.1, 2, 256 // scale, seed), list(range(n))
    elif name == "groups":
        n_prompts, k = 16 // scale, 8
        base = [_prompt(gen, 200) for _ in range(n_prompts)]
        prompts = [p for p in base for _ in range(k)]
        lengths = long_tail_lengths(n_prompts * k, 24, 1.1, 2, 256 // scale, seed + 1)
        groups = [g for g in range(n_prompts) for _ in range(k)]
    else:
        raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS}")
    reqs = [RolloutRequest(i, p, SamplingParams(temperature=1.0, max_new_tokens=t, seed=seed * 100_003 + i), g)
            for i, (p, t, g) in enumerate(zip(prompts, lengths, groups, strict=True))]
    srt = sorted(lengths)
    info = {"requests": len(reqs), "generated_tokens": sum(lengths),
            "prompt_len_mean": statistics.fmean(len(p) for p in prompts),
            "response_len_p50": srt[len(srt) // 2], "response_len_p99": srt[min(len(srt) - 1, int(0.99 * len(srt)))],
            "response_len_max": srt[-1]}
    info["p99_over_p50"] = info["response_len_p99"] / info["response_len_p50"]
    return reqs, info


class _Side:
    """One system under test, advanced one unit at a time (an engine step, or one HF static batch).

    The bench interleaves the sides unit by unit, always advancing the one that is least far
    along (generated tokens / total), so load from other processes on a shared machine falls on
    every side over the same stretch of time; each unit's wall and CPU time is added to its side.
    """

    def __init__(self, name: str, total: int, units):
        self.name, self.total, self.units = name, total, units
        self.done = self.wall = self.cpu = 0.0
        self.finished = False

    def advance(self) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            self.done += next(self.units)
        except StopIteration:
            self.finished = True
        self.wall += time.perf_counter() - w0
        self.cpu += time.process_time() - c0


def _engine_units(engine, reqs):
    """Tokens generated by each engine step."""
    for r in reqs:
        engine.add(r)
    while engine.has_unfinished():
        yield _step_tokens(engine)


def _step_tokens(engine) -> int:
    before = engine.stats["generated_tokens"]
    engine.step()
    return engine.stats["generated_tokens"] - before


def _hf_units(hf, reqs):
    """Tokens of each sample HF yields (its first sample of a batch carries the batch's compute time)."""
    for s in hf.generate(reqs):
        yield len(s.response_ids)


def _interleave(sides: list[_Side]) -> None:
    while not all(s.finished for s in sides):
        min((s for s in sides if not s.finished), key=lambda s: s.done / s.total).advance()


BACKENDS = ("engine", "vllm", "hf")
SIDES = {"engine": ("fuseflow", "fuseflow_torch_linear"), "vllm": ("vllm",), "hf": ("hf",)}


def bench_workload(model: CausalLM, name: str, slots: int, quick: bool, repeats: int, timer: str = "wall",
                   log=print, backends: tuple[str, ...] = ("engine", "hf"), vllm_dtype: str = "auto") -> dict:
    """Time the chosen backends on one workload, interleaved; report medians.

    ``engine`` runs twice (as configured and with plain torch matmuls), ``hf`` is transformers
    ``generate``, ``vllm`` is vLLM's engine (``rollout.vllm_backend``) on the same weights in
    ``vllm_dtype``, started once before timing (its start-up is not counted). `timer` picks the
    headline: "wall" (elapsed time) or "cpu" (process CPU time, which leaves out the time other
    processes held the cores; meaningful with one torch thread on a shared CPU).
    """
    from fuseflow.rollout.engine import Engine, EngineConfig
    from fuseflow.rollout.hf_backend import HFBackend

    reqs, info = make_workload(name, quick)
    hf = HFBackend(model, pad_id=0, batch_size=slots) if "hf" in backends else None
    # Half of the KV budget is the paged pool, half the decode copy: each holds every slot at its longest
    # (rounded up to a block), so nothing is preempted. HF's cache peaks at the same size, since each
    # step's torch.cat builds a new cache while the old one is alive. vLLM gets the pool's size.
    longest = -(-(max(len(r.prompt_ids) for r in reqs) + info["response_len_max"]) // 16) * 16
    cfg = dict(max_num_seqs=slots, kv_budget_tokens=2 * slots * longest, block_size=16,
               max_num_batched_tokens=max(2048, slots))
    vllm = None
    if "vllm" in backends:
        from fuseflow.rollout.vllm_backend import VLLMBackend

        vllm = VLLMBackend(model, dtype=vllm_dtype, max_num_seqs=slots, kv_budget_tokens=slots * longest,
                           max_num_batched_tokens=max(2048, slots))
        vllm.start()
    n_tok = info["generated_tokens"]
    names = [side for b in BACKENDS if b in backends for side in SIDES[b]]
    times: dict[str, list[float]] = {f"{n}_{t}_s": [] for n in names for t in ("wall", "cpu")}
    stats: dict = {}
    for rep in range(repeats):
        sides, engine = [], None
        if "engine" in backends:
            engine = Engine(model, EngineConfig(**cfg))  # fresh per run: no prefix cache carried over
            plain = Engine(model, EngineConfig(**cfg, linear_kernel="torch"))
            sides += [_Side("fuseflow", n_tok, _engine_units(engine, reqs)),
                      _Side("fuseflow_torch_linear", n_tok, _engine_units(plain, reqs))]
        if vllm is not None:
            vllm.reset_prefix_cache()  # as the fresh engines: no prefix cache carried over
            sides.append(_Side("vllm", n_tok, _engine_units(vllm, reqs)))
        if hf is not None:
            sides.append(_Side("hf", n_tok, _hf_units(hf, reqs)))
        k = rep % len(sides)
        _interleave(sides[k:] + sides[:k])  # ties go to a different side each repeat
        for side in sides:
            if side.done != n_tok:
                raise RuntimeError(f"{side.name} generated {side.done} tokens on {name}, expected {n_tok}")
            times[f"{side.name}_wall_s"].append(side.wall)
            times[f"{side.name}_cpu_s"].append(side.cpu)
        stats = engine.stats if engine is not None else {}
        log(f"  {name} rep {rep}: " + " | ".join(f"{s.name} {s.wall:.2f}s wall {s.cpu:.2f}s cpu" for s in sides))
    if vllm is not None:
        vllm.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict = {f"{n}_tok_s": n_tok / med[f"{n}_{timer}_s"] for n in names}
    out["timer"] = timer

    def ratio(a: str, b: str, t: str = timer) -> float:  # how many times faster a is than b
        return med[f"{b}_{t}_s"] / med[f"{a}_{t}_s"]

    if "engine" in backends and "hf" in backends:
        out |= {"speedup": ratio("fuseflow", "hf"), "speedup_wall": ratio("fuseflow", "hf", "wall"),
                "speedup_cpu": ratio("fuseflow", "hf", "cpu"), "speedup_torch_linear": ratio("fuseflow_torch_linear", "hf")}
    if vllm is not None:
        out["vllm_dtype"] = vllm_dtype
        if "engine" in backends:
            out["vllm_over_engine"] = ratio("vllm", "fuseflow")
        if "hf" in backends:
            out["vllm_over_hf"] = ratio("vllm", "hf")
    out |= times | info
    if stats:
        out |= {k: stats[k] for k in ("prefill_tokens_requested", "prefill_tokens_computed", "preemptions")}
    return out


PRESETS = ("tiny", "small")


def load_model(name: str, log=print) -> CausalLM:
    """A random model of a preset (``tiny``, ``small``; vocabulary ``VOCAB``), or a pretrained one as
    ``model.path`` takes it: a named model (``smollm2-135m``), a Hugging Face directory or a .gguf file.

    The workloads' prompts are random ids below ``VOCAB``, so a pretrained model needs at least that
    many tokens; what it generates from them is beside the point (every side decodes the same ids).
    """
    if name in PRESETS:
        return CausalLM.from_config(ModelConfig.preset(name, vocab_size=VOCAB), seed=0)
    from fuseflow.config import load_config
    from fuseflow.models.source import resolve_model_path

    try:
        path = resolve_model_path(name, load_config("default").cache_dir, log)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model {name}: neither a preset (tiny or small) nor a model fuseflow can load "
                                f"({e})") from None
    model = CausalLM.from_pretrained(path)
    if model.config.vocab_size < VOCAB:
        raise ValueError(f"--model {name}: its vocabulary ({model.config.vocab_size}) is smaller than the "
                         f"workloads' prompt ids (< {VOCAB}); use a model with at least {VOCAB} tokens")
    return model


def run_bench(model_name: str, quick: bool, slots: int, repeats: int, threads: int | None, timer: str = "wall",
              workloads: tuple[str, ...] = WORKLOADS, log=print, backends: tuple[str, ...] = ("engine", "hf"),
              dtype: str = "float32", model: CausalLM | None = None) -> dict:
    """The whole benchmark as a JSON-ready dict (see the module docstring); every side runs in `dtype`.
    ``model``: ``model_name``'s model when the caller loaded it already (``load_model``)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if threads is not None:
        torch.set_num_threads(threads)
    model = (model or load_model(model_name, log)).eval().to(getattr(torch, dtype))
    load_before = os.getloadavg()
    result = {"model": model_name, "device": f"cpu ({platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()})",
              "dtype": dtype, "params": model.num_parameters(), "vocab_size": model.config.vocab_size, "slots": slots,
              "repeats": repeats, "quick": quick, "backends": list(backends), "workloads": {}}
    for name in workloads:
        log(f"{model_name} / {name}")
        result["workloads"][name] = bench_workload(model, name, slots, quick, repeats, timer, log, backends, dtype)
    result["load_avg_before_after"] = [load_before[0], os.getloadavg()[0]]
    return result


def parse_backends(text: str) -> tuple[str, ...]:
    """``--backends engine,vllm,hf`` as a tuple in the bench's order; ValueError naming a wrong entry."""
    names = [b.strip() for b in text.split(",") if b.strip()]
    wrong = [b for b in names if b not in BACKENDS]
    if wrong or not names:
        raise ValueError(f"--backends {text!r}: choose from {', '.join(BACKENDS)} (comma-separated)")
    if "vllm" in names:
        from fuseflow.rollout.vllm_backend import INSTALL_HINT, vllm_available

        if not vllm_available():
            raise ValueError(INSTALL_HINT.replace("rollout.backend=vllm", "--backends vllm"))
    return tuple(b for b in BACKENDS if b in names)


def summary_line(name: str, w: dict) -> str:
    """One line per workload: tok/s of each side and the ratios between them."""
    sides = " ".join(f"{k.removesuffix('_tok_s')} {v:8.1f}" for k, v in w.items() if k.endswith("_tok_s"))
    ratios = " ".join(f"{k} {w[k]:.2f}x" for k in ("speedup", "speedup_torch_linear", "vllm_over_engine",
                                                    "vllm_over_hf") if k in w)
    return f"{name:10s} tok/s: {sides}   {ratios}"


def register(bench_app) -> None:
    """Add `rollout` to the `fuseflow bench` Typer app."""
    import typer

    @bench_app.command("rollout")
    def rollout(
        out: Path = typer.Option(..., "--out", help="Where to write the JSON result."),
        model: str = typer.Option("small", "--model", help="A random model of a preset (tiny, small), or a "
                                  "pretrained one as model.path takes it (smollm2-135m, an HF directory, a .gguf)."),
        quick: bool = typer.Option(False, "--quick", help="Quarter-size workloads, one repeat unless --repeats "
                                   "says otherwise (a smoke run)."),
        slots: int = typer.Option(32, "--slots", help="Engine sequence slots = HF static batch size."),
        repeats: int = typer.Option(None, "--repeats", help="Runs per side; the median is reported (default 3, "
                                    "1 with --quick)."),
        threads: int = typer.Option(0, "--threads", help="torch threads for both sides (0: torch default)."),
        timer: str = typer.Option("wall", "--timer", help="Headline timer: wall, or cpu (process CPU time; "
                                  "use with --threads 1 on a shared machine). Both are always recorded."),
        backends: str = typer.Option("engine,hf", "--backends", help="Comma-separated sides: engine (fuseflow's, "
                                     "also run on plain torch matmuls), vllm (needs vLLM: `make vllm`), hf."),
        dtype: str = typer.Option("float32", "--dtype", help="Weights and compute dtype: float32 or bfloat16."),
        workload: str = typer.Option("all", "--workload", help="uniform, long_tail, groups, or all."),
    ) -> None:
        """fuseflow's engine vs vLLM vs transformers generate on uniform, long_tail and groups workloads; JSON to --out."""
        if timer not in ("wall", "cpu"):
            raise typer.BadParameter(f"--timer must be wall or cpu, got {timer!r}")
        if dtype not in ("float32", "bfloat16"):
            raise typer.BadParameter(f"--dtype must be float32 or bfloat16, got {dtype!r}")
        if workload != "all" and workload not in WORKLOADS:
            raise typer.BadParameter(f"--workload must be one of {', '.join(WORKLOADS)} or all, got {workload!r}")
        repeats = repeats if repeats is not None else 1 if quick else 3
        if slots < 1 or repeats < 1 or threads < 0:
            raise typer.BadParameter(f"--slots and --repeats must be >= 1 and --threads >= 0, got "
                                     f"{slots}, {repeats}, {threads}")
        try:
            sides = parse_backends(backends)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        try:
            loaded = load_model(model, typer.echo)
        except (ValueError, FileNotFoundError) as e:  # neither a preset nor a model fuseflow can load
            raise typer.BadParameter(str(e).splitlines()[0]) from None
        result = run_bench(model, quick, slots, repeats, threads or None, timer,
                           WORKLOADS if workload == "all" else (workload,), typer.echo, sides, dtype, loaded)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        for name, w in result["workloads"].items():
            typer.echo(summary_line(name, w))
