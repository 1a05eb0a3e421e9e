"""`fuseflow bench pipeline --execute`: run serial-1F1B and the solver's fused schedule on
real stage processes and compare the measured makespans with each other and with the
solver's prediction.

One run: 2 stage processes (one intra-op thread each), actor and critic PPO steps with
pp=2. A warm-up serial step is followed by a measured one; its per-(model, stage,
phase) action times become the solver's input (fA, fB in integer units of `unit`
seconds, backward = 2 forward, as the solver models it). The solver's makespan times
`unit` is the prediction for the fused schedule; `simulate` with the measured per-stage
times gives a second, finer prediction. Then serial and fused steps alternate, so load
drifts on a shared machine hit both alike: the speedup is the median of the per-pair
ratios, and each step is held against the prediction rescaled by how long its pair's
serial step spent in actions relative to the calibration step (`load_scale`).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from fuseflow.data.batch import Batch
from fuseflow.models.config import ModelConfig
from fuseflow.schedule.pipeline import sleepbench
from fuseflow.schedule.pipeline.actions import Plan, one_f_one_b_plan, plan_from_schedule, simulate
from fuseflow.schedule.pipeline.problem import PipelineInstance
from fuseflow.schedule.pipeline.train import ModelSpec, PipelineTrainer, makespan, split_micro_batches

GEN_GROUPS = 2  # batches in flight in pipelined generation (one per stage keeps both busy)

UNIT_STEPS = 20  # the faster model's forward is about this many solver time units


def _spin(state, rank: int, ctx, active: tuple[int, ...], reps: int) -> float:
    """A fixed matmul workload on the `active` ranks; its seconds (0 elsewhere)."""
    if rank not in active:
        return 0.0
    a = torch.randn(384, 384, generator=torch.Generator().manual_seed(rank))
    t = time.perf_counter()
    for _ in range(reps):
        a @ a
    return time.perf_counter() - t


def parallel_capacity(pt: PipelineTrainer, reps: int = 300) -> float:
    """How many cores' worth of compute the 2 stage processes get at once, now: the time of
    a workload on one rank alone, times 2, over the time of both ranks running it together
    (2.0 = two free cores; 1.0 = they share one). Pipeline overlap can only pay up to this."""
    alone = pt.procs.call(_spin, ((0,), reps))[0]
    both = max(pt.procs.call(_spin, ((0, 1), reps)))
    return round(2 * alone / both, 3)


def ppo_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0) -> Batch:
    """A PPO batch of random tokens (all real: the benchmark times full-width micro-batches)
    with the fields both losses read."""
    g = torch.Generator().manual_seed(seed)
    t = prompt + response
    return Batch({
        "input_ids": torch.randint(0, vocab, (rows, t), generator=g),
        "attention_mask": torch.ones(rows, t, dtype=torch.long),
        "response_mask": torch.ones(rows, response),
        "old_logprobs": -torch.rand(rows, response, generator=g) * 4 - 4,
        "advantages": torch.randn(rows, generator=g),
        "values": torch.randn(rows, response, generator=g) * 0.1,
        "returns": torch.randn(rows, response, generator=g),
    }, {})


def stage_times(results: list[dict[str, Any]]) -> dict[tuple[str, int, bool], float]:
    """Median time of each (model, stage, backward) action kind in one step's logs."""
    per: dict[tuple[str, int, bool], list[float]] = defaultdict(list)
    for r in results:
        for label, a, b in r["times"].actions:
            model, phase, stage = label.split()
            per[(model[0], int(stage[1:]), phase[0] == "B")].append(b - a)
    return {k: statistics.median(v) for k, v in per.items()}


def busy(results: list[dict[str, Any]]) -> float:
    """Seconds spent in actions, summed over ranks (idle and waiting time left out)."""
    return sum(b - a for r in results for _, a, b in r["times"].actions)


def solver_instance(times: dict[tuple[str, int, bool], float], m_a: int, m_b: int) -> tuple[PipelineInstance, float]:
    """The solver's 2-device instance for measured action times, and its time unit (s).

    The solver has one forward time per model (the same on every stage) and backward =
    2 forward; each model's forward time is the mean over its stages of (forward +
    backward) / 3, which keeps each device's measured busy time."""
    f = {m: sum(times[(m, s, False)] + times[(m, s, True)] for s in (0, 1)) / 6 for m in ("A", "B")}
    unit = min(f.values()) / UNIT_STEPS
    return PipelineInstance(2, 2, m_a, m_b, max(1, round(f["A"] / unit)), max(1, round(f["B"] / unit)),
                            1.0, 1.0), unit


def run(model: str = "small", vocab: int = 4096, micro_batches: int = 4, rows: int = 2, prompt: int = 32,
        response: int = 64, repeats: int = 3, solver_seconds: float = 20.0, memory_cap: float | None = None,
        threads: int = 1, progress=None) -> dict[str, Any]:
    """The whole measurement (module docstring); returns the JSON record."""
    from fuseflow.schedule.pipeline.solver import solve

    say = progress or (lambda text: None)
    cfg = ModelConfig.preset(model, vocab_size=vocab)
    specs = {"A": ModelSpec("actor", cfg, seed=1, lr=1e-5), "B": ModelSpec("critic", cfg, seed=2, lr=1e-5)}
    batch = ppo_batch(rows * micro_batches, prompt, response, vocab)
    mbs = {m: split_micro_batches(batch, rows) for m in ("A", "B")}
    serial = one_f_one_b_plan(2, {"A": micro_batches, "B": micro_batches})
    say("starting 2 stage processes")
    with PipelineTrainer(specs, 2, threads=threads, timeout=600) as pt:
        say("warm-up step")
        pt.step(serial, mbs)
        capacity = [parallel_capacity(pt)]
        say("measuring stage times")
        calib = pt.step(serial, mbs)
        times = stage_times(calib)
        inst, unit = solver_instance(times, micro_batches, micro_batches)
        say(f"solving {inst.spec()}")
        res = solve(inst, seconds=solver_seconds, memory_cap=memory_cap)
        fused = plan_from_schedule(inst, res.start)
        measured: dict[str, list[float]] = {"serial": [], "fused": []}
        step_end: dict[str, list[float]] = {"serial": [], "fused": []}
        load: list[float] = []  # busy time of each serial step over the calibration step's
        plans: dict[str, Plan] = {"serial": serial, "fused": fused}
        for i in range(repeats):
            for name in ("serial", "fused"):
                say(f"step {i + 1}/{repeats}: {name}")
                out = pt.step(plans[name], mbs)
                measured[name].append(makespan(out))
                step_end[name].append(max(r["times"].end for r in out))
                if name == "serial":
                    load.append(busy(out) / busy(calib))
        capacity.append(parallel_capacity(pt))
    say("the same plans with sleeping stages")
    sleep = sleepbench.run(cfg, times, plans, mbs, repeats)
    med = {k: statistics.median(v) for k, v in measured.items()}
    serial_inst = (micro_batches + 1) * 3 * (inst.f_a + inst.f_b)  # serial 1F1B closed form, p = 2
    predicted = {"fused": res.makespan * unit, "serial": serial_inst * unit}
    simulated = {k: simulate(p, times)[0] for k, p in plans.items()}

    def paired(name: str) -> float:
        # Each step against the prediction rescaled by its pair's serial busy time: on a
        # shared machine the load drifts within a run, and this keeps the drift out.
        return statistics.median(m / (predicted[name] * f) for m, f in zip(measured[name], load, strict=True)) - 1

    return {
        "model": model, "vocab_size": vocab, "stages": 2, "micro_batches": micro_batches,
        "rows_per_micro_batch": rows, "tokens_per_row": prompt + response, "threads_per_stage": threads,
        # Median of the per-pair ratios (serial step i over fused step i, run back to back).
        "fused_speedup_vs_serial": round(statistics.median(
            a / b for a, b in zip(measured["serial"], measured["fused"], strict=True)), 4),
        "fused_speedup_of_medians": round(med["serial"] / med["fused"], 4),
        "predicted_speedup": round(predicted["serial"] / predicted["fused"], 4),
        "prediction_error": round(paired("fused"), 4),
        "serial_prediction_error": round(paired("serial"), 4),
        "prediction_error_unscaled": round(med["fused"] / predicted["fused"] - 1, 4),
        "simulated_prediction_error_unscaled": round(med["fused"] / simulated["fused"] - 1, 4),
        "parallel_capacity": capacity,  # before and after the measured steps (see parallel_capacity)
        # Stages that sleep for the calibrated times (sleepbench.py): no CPU contention.
        "sleep_fused_speedup_vs_serial": round(sleep["sleep_median_makespan_s"]["serial"]
                                               / sleep["sleep_median_makespan_s"]["fused"], 4),
        "sleep_prediction_error": round(sleep["sleep_median_makespan_s"]["fused"] / predicted["fused"] - 1, 4),
        "sleep_simulated_error": round(sleep["sleep_median_makespan_s"]["fused"] / simulated["fused"] - 1, 4),
        **sleep,
        "load_scale": [round(f, 4) for f in load],
        "measured_makespan_s": measured, "median_makespan_s": med, "step_with_optimizer_s": step_end,
        "predicted_makespan_s": predicted, "simulated_makespan_s": simulated,
        "solver": {"instance": inst.spec(), "unit_s": unit, "makespan": res.makespan, "lower_bound": res.lower_bound,
                   "peak_memory": res.peak_memory, "memory_cap": memory_cap, "seconds": res.seconds},
        "stage_times_s": {f"{m} {'B' if bw else 'F'} s{s}": round(v, 5) for (m, s, bw), v in sorted(times.items())},
        "fused_plan": fused.labels(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_generation(model: str = "small", vocab: int = 4096, prompts: int = 32, prompt_len: int = 32,
                   max_new: int = 16, repeats: int = 3, threads: int = 1, progress=None) -> dict[str, Any]:
    """Tokens per second of generation on 2 stages and on 2 data-parallel replicas.

    `pipelined`: GEN_GROUPS batches in flight, round-robin over the stages. `unpipelined`:
    the same batches one after another (one stage idles while the other decodes): the
    speedup target. `one_batch`: all prompts in a single batch on the 2 stages (the same
    KV memory as pipelined, fewer, larger forwards). `replicas`: each process samples half
    the prompts on a whole model with the foundation sampler. Alternated, medians compared.
    """
    from fuseflow.rollout.base import SamplingParams
    from fuseflow.rollout.sampler import make_requests
    from fuseflow.schedule.pipeline.generate import generate_command, replica_command

    say = progress or (lambda text: None)
    spec = ModelSpec("actor", ModelConfig.preset(model, vocab_size=vocab), seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (prompts, prompt_len), generator=g).tolist()
    # No stop token: every sample runs to max_new, so all layouts do the same work.
    reqs = make_requests(ids, SamplingParams(temperature=1.0, max_new_tokens=max_new), 1, seed=0)
    layouts = {"pipelined": (GEN_GROUPS, True), "unpipelined": (GEN_GROUPS, False), "one_batch": (1, True)}
    rates: dict[str, list[float]] = {k: [] for k in [*layouts, "replicas"]}
    with PipelineTrainer({"A": spec}, 2, threads=threads, timeout=600) as pt:
        say("generation warm-up")
        pt.procs.call(generate_command, (reqs[:2], 0, 1, 600))
        capacity = [parallel_capacity(pt)]
        for i in range(repeats):
            for name in rates:
                say(f"generation {i + 1}/{repeats}: {name}")
                if name == "replicas":
                    out = pt.procs.call(replica_command, (reqs, 0))
                else:
                    out = pt.procs.call(generate_command, (reqs, 0, *layouts[name][:1], 600, layouts[name][1]))
                tokens = sum(len(s.response_ids) for samples, _ in out for s in samples)
                rates[name].append(tokens / max(sec for _, sec in out))
        capacity.append(parallel_capacity(pt))
    med = {k: statistics.median(v) for k, v in rates.items()}

    def vs(other: str) -> float:  # median of the per-round ratios (the layouts alternate)
        return round(statistics.median(a / b for a, b in zip(rates["pipelined"], rates[other], strict=True)), 4)

    return {
        "pipelined_generation_speedup": vs("unpipelined"),
        "pipelined_vs_one_batch": vs("one_batch"),
        "pipelined_vs_replicas": vs("replicas"),
        "generation_parallel_capacity": capacity,
        "generation_tok_per_s": rates, "generation_median_tok_per_s": med,
        "generation": {"model": model, "prompts": prompts, "prompt_len": prompt_len, "max_new_tokens": max_new,
                       "batches_in_flight": GEN_GROUPS},
    }
