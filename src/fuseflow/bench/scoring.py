"""``fuseflow bench scoring``: one RL step's scoring forwards replayed with the prompt cache on and off.

A local-backend run in ``--mode`` trains up to ``--step``; every scoring call of that step (the
critics' values, the reference's and the actor's old log-probs, each micro-batch as the mode sent
it, in order) is recorded with its worker. The replay runs those calls again, the arms alternating
in ABBA pairs (on/off, then off/on): with the cache each worker starts from an empty
``PromptCache`` (as after an update), without it each worker's ``cache_prompts`` is off. Reported:
the median seconds per arm, the median of the per-pair ratios (cache on / off), and the tokens each
arm ran through the models' embeddings (counted, not estimated). Both arms compute the same values
(tests/test_prompt_cache.py); only the time and the tokens differ.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import cpu_name, write_result

SCORING = ("compute_values", "compute_logprobs")


def _config(preset: str, mode: str, step: int, quick: bool, overrides: list[str]):
    from fuseflow.config import load_config

    if preset == "sort":  # the fusion bench's PPO on `sort`: critic, reference and old log-probs
        from .fusion import fusion_overrides

        return load_config("sort", fusion_overrides(mode, 2, step, quick, overrides, "local"))
    if preset == "smollm":  # GRPO with LoRA on SmolLM2-135M: the reference's log-probs
        return load_config("smollm", [f"trainer.steps={step}", f"schedule.mode={mode}", "schedule.rollout_workers=2",
                                      "trainer.eval_every=1000", "trainer.save_every=1000", *overrides])
    raise ValueError(f"--preset must be sort or smollm, got {preset!r}")


def record_step(cfg, step: int, log=print) -> list[tuple]:
    """Train ``cfg`` (local backend) to ``step``; the ``(worker, method, batch)`` of each scoring call
    of that step, in order."""
    from fuseflow.trainer import RLTrainer

    if cfg.backend != "local":
        raise ValueError("bench scoring records the local backend's workers (backend=local)")
    tr = RLTrainer(cfg, Path(tempfile.mkdtemp(prefix="fuseflow-scoring-")), log=log)
    calls: list[tuple] = []
    recording = [False]
    try:
        for group in {id(g): g for g in (tr.actor, tr.reference, *tr.critics) if g is not None}.values():
            worker = group.worker
            for name in SCORING:
                if not hasattr(type(worker), name):
                    continue
                method = getattr(worker, name)

                def wrapped(batch, _w=worker, _m=method, _n=name):
                    if recording[0]:
                        calls.append((_w, _n, batch))
                    return _m(batch)
                setattr(worker, name, wrapped)  # an instance attribute: LocalGroup calls getattr(worker, name)
        for s in range(1, step + 1):
            recording[0] = s == step
            tr.step(s)
    finally:
        tr.close()
    for worker, name, _ in calls:  # the class's own methods again for the replay
        worker.__dict__.pop(name, None)
    if not calls:
        raise ValueError(f"step {step} of mode {cfg.schedule.mode} made no scoring call to record")
    return calls


def replay(calls: list[tuple], cache: bool, tokens: list[int]) -> tuple[float, int]:
    """Seconds and embedded tokens of running ``calls`` once, with fresh prompt caches or none."""
    workers = {id(w): w for w, _, _ in calls}.values()
    for w in workers:
        w.cache_prompts = cache
        w.__dict__.pop("prompt_cache", None)
    tokens.clear()
    t0 = time.perf_counter()
    with torch.no_grad():
        for w, name, batch in calls:
            getattr(w, name)(batch)
    return time.perf_counter() - t0, sum(tokens)


def run_scoring_bench(preset: str = "sort", mode: str = "fused", step: int = 2, repeats: int = 10,
                      quick: bool = False, overrides: list[str] | None = None, log=print) -> dict:
    """Record one step's scoring calls and replay them with the prompt cache on and off (see module doc)."""
    if repeats < 2 or repeats % 2:
        raise ValueError(f"--repeats must be an even number >= 2 (ABBA pairs), got {repeats}")
    if step < 1:
        raise ValueError(f"--step must be >= 1, got {step}")
    cfg = _config(preset, mode, step, quick, list(overrides or []))
    if not cfg.schedule.shared_prefix:
        raise ValueError("the prompt cache serves shared-prefix forwards: leave schedule.shared_prefix on")
    calls = record_step(cfg, step, log=lambda *a, **k: None)
    tokens: list[int] = []
    hooks = [w.model.model.embed_tokens.register_forward_hook(lambda m, i, o: tokens.append(i[0].numel()))
             for w in {id(w): w for w, _, _ in calls}.values()]
    arms: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    try:
        replay(calls, True, tokens)  # warm-up: first-call allocations count in neither arm
        for r in range(repeats // 2):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                arms[on].append(replay(calls, on, tokens))
            log(f"pair {r + 1}/{repeats // 2}: cache on {arms[True][-1][0] * 1e3:.0f} ms, "
                f"off {arms[False][-1][0] * 1e3:.0f} ms")
    finally:
        for h in hooks:
            h.remove()
    ratios = [a[0] / b[0] for a, b in zip(arms[True], arms[False], strict=True)]
    summary = {name: {"seconds_median": statistics.median(t for t, _ in arms[on]),
                      "seconds_runs": [t for t, _ in arms[on]], "tokens": arms[on][0][1]}
               for name, on in (("cache", True), ("no_cache", False))}
    return {"benchmark": "scoring_prompt_cache", "preset": preset, "mode": mode, "step": step,
            "device": "cpu", "cpu": cpu_name(), "torch_threads": torch.get_num_threads(),
            "calls": len(calls), "samples_per_call": [len(b) for _, _, b in calls],
            **summary, "time_ratio_pairs": ratios, "time_ratio_cache_vs_none": statistics.median(ratios),
            "tokens_ratio_cache_vs_none": summary["cache"]["tokens"] / summary["no_cache"]["tokens"]}


def register(bench_app) -> None:
    """Add ``fuseflow bench scoring`` to the ``bench`` Typer app."""
    import typer

    @bench_app.command("scoring")
    def bench_scoring(overrides: list[str] = typer.Argument(None, help="Dotted overrides for the run."),
                      out: Path = typer.Option(None, "--out", "-o", help="Write the JSON here."),
                      preset: str = typer.Option("sort", "--preset", help="sort (the fusion bench's PPO) or "
                                                 "smollm (GRPO with LoRA on SmolLM2-135M)."),
                      mode: str = typer.Option("fused", "--mode", help="The execution mode whose step is "
                                               "replayed (local backend)."),
                      step: int = typer.Option(2, "--step", help="The step recorded (its predecessors train)."),
                      repeats: int = typer.Option(10, "--repeats", help="Replays per arm, an even number."),
                      quick: bool = typer.Option(False, "--quick", help="sort only: a seconds-scale run.")) -> None:
        """One step's scoring forwards replayed with the prompt cache on and off: time and tokens."""
        from fuseflow.config import ConfigError
        from fuseflow.console import console, fail

        try:
            r = run_scoring_bench(preset, mode, step, repeats, quick, overrides, log=console.print)
        except (ConfigError, ValueError, FileNotFoundError, ImportError) as e:
            fail(str(e))
        for name in ("cache", "no_cache"):
            console.print(f"{name:8s} {r[name]['seconds_median'] * 1e3:.0f} ms median, {r[name]['tokens']} tokens")
        console.print(f"{r['calls']} scoring calls of step {r['step']} ({r['preset']}, {r['mode']}): cache on/off "
                      f"x{r['time_ratio_cache_vs_none']:.3f} in time (median of {len(r['time_ratio_pairs'])} "
                      f"pairs), x{r['tokens_ratio_cache_vs_none']:.3f} in tokens", soft_wrap=True)
        write_result(out, r)
