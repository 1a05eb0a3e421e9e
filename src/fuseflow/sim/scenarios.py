"""Shipped scenarios: the settings of the three papers, replayed by the simulator.

- rlhfuse: PPO with LLaMA actor/critic pairs (13B-65B) on 256 Hopper GPUs, global
  batch 512, generation caps 512-2048, long-tailed lengths; sequential vs fused.
- hybridflow: PPO with Llama 7B-70B (all four models the same size) on 16-128 A100s,
  prompt and response both 1024 tokens; best colocate / split / standalone placement.
- rlhfless: Qwen2.5 3B/7B on 16 L40S, GRPO and PPO with a rule-based reward;
  sequential (verl's own example layout, reserved GPUs) vs elastic (serverless rollout).

Workload shapes are fixed here, before any result, and documented in docs/simulation.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .costmodel import Layout
from .engine import SimResult, simulate
from .hardware import get_hardware
from .modelspec import get_model
from .placement import DeviceSet, Plan, Problem, estimate
from .policies import parse_policy
from .search import Searcher
from .trace import write_gantt, write_trace
from .workload import LengthDist, Workload

# Natural response-length distribution of chat RLHF (before the cap): median 256 tokens,
# log-std 0.9 (p90 ~ 800, p99 ~ 2100), half of the log-variance per prompt.
RLHFUSE_RESPONSE = dict(median=256.0, sigma=0.9)
RLHFUSE_PAIRS = (("llama-13b", "llama-33b"), ("llama-33b", "llama-65b"), ("llama-65b", "llama-65b"))
RLHFUSE_CAPS = (512, 1024, 2048)
HYBRIDFLOW_MODELS = ("llama-7b", "llama-13b", "llama-33b", "llama-70b")
HYBRIDFLOW_GPUS = (16, 32, 64, 96, 128)
HYBRIDFLOW_KINDS = ("colocate", "split", "standalone")
# Reasoning-style RLVR responses (math): median 600 tokens, long tail to a 4096 cap.
RLHFLESS_RESPONSE = dict(median=600.0, sigma=0.8, max_len=4096)
# verl's published recipes for these models (examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh,
# examples/ppo_trainer/run_qwen2.5-3b_seq_balance.sh, examples/grpo_trainer/run_qwen2-7b.sh): every
# role colocated, FSDP over all devices with gradient checkpointing, vLLM rollout at tensor parallel 2.
VERL_ROLLOUT_TP = 2


def _policy_row(res: SimResult, base: SimResult) -> dict:
    return {
        "iteration_seconds": round(res.iteration_seconds, 4),
        "samples_per_second": round(res.samples_per_second, 3),
        "tokens_per_second": round(res.tokens_per_second, 1),
        "gpu_seconds": round(res.gpu_seconds, 2),
        "gpu_busy_fraction": round(res.gpu_busy_fraction, 3),
        "speedup_vs_sequential": round(base.iteration_seconds / res.iteration_seconds, 4),
        "gen_plus_inference_seconds": round(res.gen_plus_inference_seconds, 4),
        "stages": {k: round(v, 4) for k, v in res.stages.items()},
        "info": res.info,
    }


def _best_plan(problem: Problem, kinds: set[str]) -> Plan | None:
    found = Searcher(problem).enumerate(kinds)
    return found[0].plan if found else None


def verl_plan(problem: Problem, gen_tp: int = VERL_ROLLOUT_TP) -> Plan:
    """verl's default layout, the baseline RLHFless measures against (not a searched plan).

    All roles on one set; each trains or infers with FSDP (ZeRO-3) over every device,
    trainable roles with activation checkpointing; rollout replicas of `gen_tp` devices.
    Raises ValueError when that layout does not fit the problem's devices.
    """
    if problem.gpus % gen_tp:
        raise ValueError(f"gen_tp={gen_tp}: must divide the {problem.gpus} devices")
    lays = tuple((r, Layout(tp=1, pp=1, dp=problem.gpus, zero=3, recompute=problem.trainable(r))) for r in problem.roles)
    plan = Plan((DeviceSet(problem.roles, problem.gpus),), lays, (gen_tp, 1))
    costs = estimate(problem, plan, problem.workload.step(0))
    if not costs.feasible:
        raise ValueError(f"verl layout on {problem.gpus} x {problem.hw.name}: {costs.why}")
    return plan


OnCase = Callable[[int, int, str], None]  # (cases done, cases in all, the case just finished)


def _add(cases: list[dict], case: dict, on_case: OnCase | None, total: int) -> None:
    """Append a finished case and report it to ``on_case`` (counted by the list itself)."""
    cases.append(case)
    if on_case is not None:
        on_case(len(cases), total, case["case"])


def _trace(trace_dir: Path | None, stem: str, res: SimResult) -> None:
    if trace_dir is None:
        return
    write_trace(res.events, trace_dir / f"{stem}.json")
    write_gantt(res.events, trace_dir / f"{stem}.png", title=stem)


def rlhfuse(trace_dir: Path | None = None, iterations: int = 1, on_case: OnCase | None = None) -> dict:
    """Sequential vs fused on the best colocated plan of each actor/critic pair and cap."""
    hw = get_hardware("H100")
    cases = []
    total = len(RLHFUSE_PAIRS) * len(RLHFUSE_CAPS)
    for actor, critic in RLHFUSE_PAIRS:
        for cap in RLHFUSE_CAPS:
            wl = Workload(
                prompts=512, prompt_len=LengthDist("lognormal", max_len=1024, median=256, sigma=0.5),
                response_len=LengthDist("lognormal", max_len=cap, **RLHFUSE_RESPONSE), algorithm="ppo",
                rollout_logprobs=True,  # RLHFuse's inference stage: reference, critic, reward only
            )  # fmt: skip
            prob = Problem.build(get_model(actor), hw, 256, wl, critic=get_model(critic))
            plan = _best_plan(prob, {"colocate"})
            name = f"{actor}/{critic}/max{cap}"
            seq = simulate(prob, plan, parse_policy("sequential"), iterations)
            fus = simulate(prob, plan, parse_policy("fused"), iterations)
            for pol, res in (("sequential", seq), ("fused", fus)):
                _trace(trace_dir, f"rlhfuse_{name.replace('/', '_')}_{pol}", res)
            _add(cases, {
                "case": name, "plan": plan.describe(),
                "policies": {"sequential": _policy_row(seq, seq), "fused": _policy_row(fus, seq)},
                "gen_plus_inference_speedup": round(seq.gen_plus_inference_seconds / fus.gen_plus_inference_seconds, 4),
                "end_to_end_speedup": round(seq.iteration_seconds / fus.iteration_seconds, 4),
            }, on_case, total)  # fmt: skip
    gi = [c["gen_plus_inference_speedup"] for c in cases]
    e2e = [c["end_to_end_speedup"] for c in cases]
    return {
        "scenario": "rlhfuse", "hardware": "256 x H100", "cases": cases,
        "summary": {"gen_plus_inference_speedup": {"min": min(gi), "max": max(gi)},
                    "end_to_end_speedup": {"min": min(e2e), "max": max(e2e)},
                    "paper": {"gen_plus_inference_speedup": [1.2, 1.6], "end_to_end_speedup": [1.2, 1.4]}},
    }  # fmt: skip


def hybridflow(trace_dir: Path | None = None, iterations: int = 1, on_case: OnCase | None = None) -> dict:
    """Best colocate / split / standalone plan per model size and GPU count (sequential)."""
    hw = get_hardware("A100")
    wl = Workload(prompts=1024, prompt_len=LengthDist("fixed", max_len=1024),
                  response_len=LengthDist("fixed", max_len=1024), algorithm="ppo")  # fmt: skip
    cases = []
    total = len(HYBRIDFLOW_MODELS) * len(HYBRIDFLOW_GPUS)
    for model in HYBRIDFLOW_MODELS:
        for gpus in HYBRIDFLOW_GPUS:
            prob = Problem.build(get_model(model), hw, gpus, wl)
            found = Searcher(prob).enumerate(set(HYBRIDFLOW_KINDS))
            by_kind: dict[str, dict] = {}
            for cand in found:  # sorted by analytic cost: the first of each kind is its best
                if cand.plan.kind in by_kind:
                    continue
                res = simulate(prob, cand.plan, parse_policy("sequential"), iterations)
                by_kind[cand.plan.kind] = {"iteration_seconds": round(res.iteration_seconds, 4),
                                           "plan": cand.plan.describe(), "result": res, "obj": cand.plan}  # fmt: skip
            case: dict = {"case": f"{model}/{gpus}gpus", "model": model, "gpus": gpus}
            if not by_kind:
                case.update(feasible=False, placements={}, policies={})
                _add(cases, case, on_case, total)
                continue
            best_kind = min(by_kind, key=lambda k: by_kind[k]["iteration_seconds"])
            best = by_kind[best_kind]
            seq = best["result"]
            fus = simulate(prob, best["obj"], parse_policy("fused"), iterations)
            for v in by_kind.values():
                del v["result"], v["obj"]
            _trace(trace_dir, f"hybridflow_{model}_{gpus}_{best_kind}_sequential", seq)
            case.update(feasible=True, best_placement=best_kind, placements=by_kind,
                        policies={"sequential": _policy_row(seq, seq), "fused": _policy_row(fus, seq)})  # fmt: skip
            _add(cases, case, on_case, total)
    return {"scenario": "hybridflow", "hardware": "16-128 x A100", "cases": cases,
            "summary": {c["case"]: c.get("best_placement", "infeasible") for c in cases}}  # fmt: skip


def rlhfless(trace_dir: Path | None = None, iterations: int = 1, on_case: OnCase | None = None) -> dict:
    """Reserved sequential vs serverless elastic rollout (GPU-seconds and slowdown).

    Both run on verl's example layout (`verl_plan`): RLHFless is built on verl and
    reports its savings against verl as users run it, not against a searched plan.
    """
    hw = get_hardware("L40S")
    cases = []
    runs = [(model, algo) for model in ("qwen2.5-3b", "qwen2.5-7b") for algo in ("grpo", "ppo")]
    for model, algo in runs:
        prompts, k = (64, 8) if algo == "grpo" else (512, 1)
        wl = Workload(
            prompts=prompts, samples_per_prompt=k, algorithm=algo, reward_model=False,
            prompt_len=LengthDist("lognormal", max_len=512, median=150, sigma=0.4),
            response_len=LengthDist("lognormal", **RLHFLESS_RESPONSE),
        )  # fmt: skip
        prob = Problem.build(get_model(model), hw, 16, wl)
        plan = verl_plan(prob)
        name = f"{model}/{algo}"
        rows, base = {}, None
        for pol in ("sequential", "elastic", "fused", "elastic+fused"):
            res = simulate(prob, plan, parse_policy(pol), iterations)
            base = base or res
            rows[pol] = _policy_row(res, base)
            if pol in ("sequential", "elastic"):
                _trace(trace_dir, f"rlhfless_{name.replace('/', '_')}_{pol}", res)
        seq, ela = rows["sequential"], rows["elastic"]
        _add(cases, {
            "case": name, "plan": plan.describe(), "policies": rows,
            "elastic_gpu_seconds_saving": round(1 - ela["gpu_seconds"] / seq["gpu_seconds"], 4),
            "elastic_slowdown": round(ela["iteration_seconds"] / seq["iteration_seconds"] - 1, 4),
        }, on_case, len(runs))  # fmt: skip
    return {"scenario": "rlhfless", "hardware": "16 x L40S", "cases": cases,
            "summary": {c["case"]: {"gpu_seconds_saving": c["elastic_gpu_seconds_saving"],
                                    "slowdown": c["elastic_slowdown"]} for c in cases},
            "paper": {"gpu_seconds_saving_at_least": 0.30, "slowdown_at_most": 0.10}}  # fmt: skip


SCENARIOS: dict[str, Callable[..., dict]] = {"rlhfuse": rlhfuse, "hybridflow": hybridflow, "rlhfless": rlhfless}


def run_scenario(name: str, trace_dir: str | Path | None = None, iterations: int = 1,
                 on_case: OnCase | None = None) -> dict:
    """Run a shipped scenario by name and return its JSON-ready result.

    ``on_case(done, total, case)`` is called after each case (the CLI's progress bar:
    `hybridflow` takes 30-60 s).
    """
    if name not in SCENARIOS:
        raise ValueError(f"scenario {name!r}: unknown; choose one of: {', '.join(SCENARIOS)}")
    return SCENARIOS[name](Path(trace_dir) if trace_dir else None, iterations, on_case)
