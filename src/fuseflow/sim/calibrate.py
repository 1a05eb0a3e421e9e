"""Calibration: fit the efficiency factors to a real fuseflow run, then predict its step time.

A run directory holds `config.yaml`, `metrics.jsonl` (one record per RL step),
`trace.json` (Chrome trace, one "X" event per stage per step) and `model_config.json`
(the policy's Hugging Face config). For every step we rebuild that step's workload
from its metrics (sample count, mean prompt length, mean and max response length),
price each traced stage with the same cost model the simulator uses, and fit the
efficiency factors (train/infer MFU, decode bandwidth use, per-layer latency, host
seconds per sample) by least squares on log stage times (Nelder-Mead over log-factors).
The prediction of a step puts its predicted stages together as the run's `schedule.mode`
runs them (`runtime.step_seconds`): their sum for `sequential`, overlapped by the pooled
strategies' own rules for `fused`, `async` and the rest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import yaml

from fuseflow.policy.microbatch import group_by_length

from .costmodel import INFER_MICRO_BATCH_TOKENS, DecodeModel, Layout, infer_cost, train_cost
from .generation import Seq, run_replica
from .hardware import HardwareSpec, get_hardware
from .modelspec import ModelSpec, from_hf_config
from .runtime import INFERENCE, RuntimeMode, step_seconds

STAGES = ("generate", "reference", "values", "reward", "old_logprob", "advantages",
          "critic_update", "actor_update", "weight_sync", "inference")  # fmt: skip
# Pooled strategies trace their inference micro-batches as "inference" (every stage of the
# micro-batch in one box); it is fitted against the sum of those stages' predictions.
# Starts of the fit besides the spec's own factors (see `fit`): per-layer latency near zero, MFUs near one.
ALT_STARTS = ({"layer_latency_s": 1e-6}, {"train_mfu": 0.9, "infer_mfu": 0.9})
FIT_STARTS = 1 + len(ALT_STARTS)
# Factors fitted, with the bounds that keep them physical.
FACTORS = {"train_mfu": (1e-4, 1.0), "infer_mfu": (1e-4, 1.0), "decode_mbu": (1e-3, 1.0),
           "layer_latency_s": (1e-7, 1e-1), "host_seconds_per_sample": (1e-7, 1.0)}  # fmt: skip


@dataclass
class StepRecord:
    """What one RL step did (from metrics.jsonl) and how long each stage took (from trace.json)."""

    step: int
    samples: int
    prompt_mean: float
    response_mean: float
    response_max: int
    step_seconds: float
    stages: dict[str, float] = field(default_factory=dict)
    prompt_max: float = 0.0  # 0: unknown (older metrics), taken as the mean
    replicas: int = 0  # rollout workers this step used (elastic's `elastic/replicas`); 0: the pool's size


@dataclass
class RunData:
    """A run directory's model, the batch settings the cost model needs, and its steps."""

    model: ModelSpec
    algorithm: str
    mini_batch_size: int
    micro_batch_size: int
    epochs: int
    steps: list[StepRecord]
    # Runs since the length-sorted micro-batches (config schedule.token_budget) group rows by
    # length and trim each group to its longest row; None: older runs, padded to the batch.
    token_budget: int | None = None
    padded_prompts: bool = True  # the old sampler left-pads prompts; the rollout engine does not
    mode: RuntimeMode = field(default_factory=RuntimeMode)
    group_size: int = 1  # samples per prompt: rollout workers get whole groups
    old_from_rollout: bool = False  # algorithm.old_logprobs=rollout: no old-log-prob forward


def load_run(run_dir: str | Path, need_trace: bool = True) -> RunData:
    """Read a run directory; errors name the missing file or key and what to do.

    Fitting needs the per-stage times of `trace.json`; predicting a run's step time
    (`need_trace=False`) needs only its config and metrics.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"run_dir {str(run)!r}: not a directory; pass a fuseflow run directory")
    for name in ("config.yaml", "metrics.jsonl") + (("trace.json",) if need_trace else ()):
        if not (run / name).is_file():
            raise ValueError(f"run_dir {str(run)!r}: missing {name}; pass a directory written by `fuseflow train`")
    cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    mc = run / "model_config.json"
    if not mc.is_file() and (cfg.get("model") or {}).get("path"):
        mc = Path(cfg["model"]["path"]) / "config.json"
    if not mc.is_file():
        raise ValueError(f"run_dir {str(run)!r}: missing model_config.json (the policy's HF config.json)")
    model = from_hf_config(json.loads(mc.read_text()), name=(cfg.get("model") or {}).get("size", "policy"))
    trainer = cfg.get("trainer") or {}
    by_track: dict[int, dict[tuple[str, int], float]] = {}
    trace = run / "trace.json"
    events = json.loads(trace.read_text()).get("traceEvents", []) if trace.is_file() else []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("name") not in STAGES:
            continue
        step = int((ev.get("args") or {}).get("step", -1))
        key = (ev["name"], int(ev.get("tid", 0)))
        tracks = by_track.setdefault(step, {})
        tracks[key] = tracks.get(key, 0.0) + float(ev["dur"]) / 1e6
    by_step = {step: _stage_seconds(tracks) for step, tracks in by_track.items()}
    steps = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        keys = ("step", "time/step_seconds", "rollout/num_samples", "rollout/response_length_mean",
                "rollout/response_length_max", "rollout/prompt_length_mean")  # fmt: skip
        if any(k not in m for k in keys):
            continue  # eval-only or partial records
        step = int(m["step"])
        steps.append(StepRecord(step, int(m["rollout/num_samples"]), float(m["rollout/prompt_length_mean"]),
                                float(m["rollout/response_length_mean"]), int(m["rollout/response_length_max"]),
                                float(m["time/step_seconds"]), by_step.get(step, {}),
                                float(m.get("rollout/prompt_length_max", 0.0)),
                                int(m.get("elastic/replicas", 0))))  # fmt: skip
    steps = [s for s in steps if s.stages or not need_trace]
    if not steps:
        raise ValueError(f"run_dir {str(run)!r}: no step has both metrics and trace events")
    sched = cfg.get("schedule") or {}
    budget = sched.get("token_budget")
    backend = (cfg.get("rollout") or {}).get("backend", "sampler")
    mode = RuntimeMode(str(sched.get("mode", "sequential")), int(sched.get("rollout_workers", 1)),
                       int(sched.get("max_staleness", 1)))  # fmt: skip
    algo = cfg.get("algorithm") or {}
    return RunData(model, algo.get("name", "grpo"), int(trainer.get("mini_batch_size", 1 << 30)),
                   int(trainer.get("micro_batch_size", 1 << 30)), int(trainer.get("epochs", 1)), steps,
                   int(budget) if budget else None, backend != "engine", mode,
                   int(algo.get("group_size", 1)), algo.get("old_logprobs") == "rollout")  # fmt: skip


def _stage_seconds(tracks: dict[tuple[str, int], float]) -> dict[str, float]:
    """One step's seconds per stage from its per-(stage, track) sums: rollout workers decode their
    shards side by side, so "generate" is the longest track; every other stage is summed."""
    out: dict[str, float] = {}
    for (name, _track), sec in tracks.items():
        out[name] = max(out.get(name, 0.0), sec) if name == "generate" else out.get(name, 0.0) + sec
    return out


def step_lengths(rec: StepRecord) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (prompt, response) lengths consistent with a step's mean and max.

    The metrics give only the mean and max, so one sample runs to the max and the
    others share the rest equally: decode then takes `max` rounds and emits the right
    token count, which are the two quantities the decode cost depends on most.
    """
    n = max(rec.samples, 1)
    resp = _one_long(n, rec.response_mean, rec.response_max)
    if n > 1 and rec.prompt_max > rec.prompt_mean:  # the same split for prompts, when the max is logged
        prompt = _one_long(n, rec.prompt_mean, rec.prompt_max)
    else:
        prompt = np.full(n, max(1.0, rec.prompt_mean))
    return np.round(prompt).astype(int), np.round(resp).astype(int)


def _one_long(n: int, mean: float, longest: float) -> np.ndarray:
    """(n,) lengths with mean `mean`: one row at `longest`, the others sharing the rest (at least 1)."""
    out = np.full(n, mean, dtype=float)
    if n > 1:
        out[:] = max(1.0, (n * mean - longest) / (n - 1))
        out[0] = longest
    return out


def trimmed_widths(lengths: np.ndarray, budget: int, max_rows: int, prompt: np.ndarray | None = None) -> np.ndarray:
    """(N,) the width each row is computed at under length-sorted, trimmed micro-batches.

    The same grouping as the workers' (`fuseflow.data.batch.length_sorted_chunks`: rows
    shortest first, a group closes when rows x (longest prompt + longest response) would pass
    `budget`), each group cut into pieces of at most `max_rows` rows as training's micro-batches
    are, each piece trimmed to its longest prompt plus longest response (`trim_padding`); a row
    costs its piece's width. The grouping is the workers' own (`policy.microbatch.group_by_length`);
    `tests/test_sim_calibrate_widths.py` also pins the widths to the workers' functions on random
    batches. `lengths` are real tokens per row; `prompt` (default 0) is the
    prompt part of each, since prompt and response are padded separately.
    Example: lengths [6, 3, 3, 2], budget 12, max_rows 8 -> widths [6, 3, 3, 3]
    ([2, 3, 3] fits at width 3, 4 x 6 = 24 does not).
    """
    total = np.asarray(lengths, dtype=int)  # (N,)
    head = np.zeros_like(total) if prompt is None else np.asarray(prompt, dtype=int)  # (N,)
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if head.shape != total.shape:
        raise ValueError(f"prompt must hold one length per row: shape {head.shape}, lengths {total.shape}")
    bad = np.flatnonzero((head < 0) | (head > total))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"prompt must hold lengths between 0 and the row's length: row {i} has prompt "
                         f"{int(head[i])} of {int(total[i])} tokens")  # fmt: skip
    tail = total - head  # (N,) response part
    widths = np.empty(len(total), dtype=float)
    for group in group_by_length(head.tolist(), tail.tolist(), budget):
        for k in range(0, len(group), max_rows):  # training's micro-batches hold at most max_rows rows
            rows = group[k : k + max_rows]
            widths[rows] = int(head[rows].max()) + max(int(tail[rows].max()), 1)  # trim keeps one response column
    return widths


@dataclass(frozen=True)
class StepShapes:
    """The hardware-independent shapes of one step: what the loss needs per record, built once.

    Rebuilding the per-sample lengths and micro-batch widths for every loss evaluation cost
    the optimiser most of its time; the factors change only how these shapes are priced.
    """

    seq: np.ndarray  # (N,) width each row is computed at in inference
    train_seq: np.ndarray  # (N,) width each row is computed at in training
    mb_tokens: int  # padded tokens per inference micro-batch
    train_mb: int  # padded tokens per training micro-batch
    mini: int  # optimizer steps (mini-batches) per epoch
    # Decode workload, (context at start, response tokens) per row; `Seq`s are built per pricing
    # because the decode simulation advances them in place.
    decode: tuple[tuple[int, int], ...]
    # Sample indices each rollout worker decodes (one shard for the plain strategy).
    shards: tuple[tuple[int, ...], ...] = ()

    @property
    def samples(self) -> int:
        """Number of samples (rows) in the step."""
        return len(self.seq)


def step_shapes(run: RunData, rec: StepRecord) -> StepShapes:
    """Per-sample lengths, micro-batch widths and decode workload of one step of `run`."""
    prompt, resp = step_lengths(rec)
    n = len(resp)
    p_max = max(rec.prompt_max, float(prompt.max()))
    mini = max(1, n // min(run.mini_batch_size, n))
    if run.token_budget is None:
        # Older runs: batches padded (prompts on the left to the longest prompt, responses on
        # the right to the longest response) and never unpadded, so every forward and
        # backward runs on n x (prompt_max + response_max) tokens.
        seq = train_seq = np.full(n, p_max + float(resp.max()))
        mb_tokens = train_mb = max(1, int(min(run.micro_batch_size, n) * float(seq[0])))
    else:
        # Length-sorted micro-batches trimmed to their longest row, within the token budget.
        real = prompt + resp
        seq = trimmed_widths(real, run.token_budget, n, prompt=prompt)
        train_seq = trimmed_widths(real, run.token_budget, min(run.micro_batch_size, n), prompt=prompt)
        mb_tokens = run.token_budget
        # Training micro-batches also hold at most micro_batch_size rows.
        train_mb = max(1, int(min(run.token_budget, min(run.micro_batch_size, n) * float(train_seq.mean()))))
    # The old sampler starts every row's KV context at the longest prompt; the engine at its own.
    decode = tuple((int(p_max) if run.padded_prompts else int(p), int(r))
                   for p, r in zip(prompt, resp, strict=True))  # fmt: skip
    return StepShapes(seq, train_seq, mb_tokens, train_mb, mini, decode, _shards(run, rec, n))


def _shards(run: RunData, rec: StepRecord, n: int) -> tuple[tuple[int, ...], ...]:
    """Whole prompt groups split evenly over the step's rollout workers, as `Pooled._shards` does."""
    workers = (rec.replicas or run.mode.workers) if run.mode.pooled else 1
    size = max(1, run.group_size)
    groups = [tuple(range(i, min(i + size, n))) for i in range(0, n, size)]
    bounds = [round(i * len(groups) / workers) for i in range(workers + 1)]
    return tuple(tuple(x for g in groups[bounds[i] : bounds[i + 1]] for x in g) for i in range(workers))


def decode_finishes(run: RunData, shapes: StepShapes, hw: HardwareSpec) -> list[list[tuple[int, float]]]:
    """(sample, finish seconds) per rollout worker, each decoding its shard from time 0."""
    dm = DecodeModel(run.model, hw)
    shards = shapes.shards or (tuple(range(shapes.samples)),)
    return [run_replica(dm, [Seq(i, *shapes.decode[i]) for i in shard]).finishes for shard in shards]


def price_stages(run: RunData, shapes: StepShapes, hw: HardwareSpec) -> dict[str, float]:
    """Predicted seconds of each stage of a step with `shapes`, priced with `hw`'s factors."""
    m, lay, s = run.model, Layout(), shapes
    host = hw.efficiency.host_seconds_per_sample * s.samples
    infer = infer_cost(m, hw, lay, s.seq, s.mb_tokens).seconds
    out = {
        "generate": max((t for f in decode_finishes(run, s, hw) for _, t in f), default=0.0),
        "reference": infer,
        "old_logprob": infer,
        "reward": host,
        "advantages": host,
        "actor_update": train_cost(m, hw, lay, s.train_seq, s.mini, run.epochs, s.train_mb).seconds,
        "weight_sync": 0.0,  # the CPU sampler shares the trainer's weights: nothing moves
    }
    if run.old_from_rollout:  # the rollout's own log-probs: the stage does not run
        del out["old_logprob"]
    if run.algorithm == "ppo":
        value = m.as_value_model()
        out["values"] = infer_cost(value, hw, lay, s.seq, s.mb_tokens).seconds
        out["critic_update"] = train_cost(value, hw, lay, s.train_seq, s.mini, run.epochs, s.train_mb).seconds
    return out


def predict_stages(run: RunData, rec: StepRecord, hw: HardwareSpec) -> dict[str, float]:
    """Predicted seconds of each stage of one step of a fuseflow run on one device."""
    return price_stages(run, step_shapes(run, rec), hw)


def predict_step(run: RunData, shapes: StepShapes, hw: HardwareSpec, priced: dict[str, float] | None = None) -> float:
    """Predicted seconds of one step: its priced stages put together as the run's mode runs them."""
    priced = price_stages(run, shapes, hw) if priced is None else priced
    if not run.mode.pooled:
        return sum(priced.values())
    width = [p + r for p, r in shapes.decode]
    budget = run.token_budget or INFER_MICRO_BATCH_TOKENS
    value = run.model.as_value_model() if run.algorithm == "ppo" else None

    def chunk(rows: list[int], names: tuple[str, ...]) -> float:
        # A micro-batch is trimmed to its longest row, so every row costs that width.
        lens = np.full(len(rows), max(width[i] for i in rows), dtype=float)
        total = 0.0
        for name in names:
            if name == "reward":
                total += hw.efficiency.host_seconds_per_sample * len(rows)
            elif name == "values" and value is not None:
                total += infer_cost(value, hw, Layout(), lens, budget).seconds
            elif name in ("reference", "old_logprob"):
                total += infer_cost(run.model, hw, Layout(), lens, budget).seconds
        return total

    return step_seconds(run.mode, priced, decode_finishes(run, shapes, hw), width, budget, chunk)


def _with_inference(priced: dict[str, float]) -> dict[str, float]:
    """`priced` plus "inference": the pooled strategies trace their micro-batches' stages as one box."""
    return priced | {"inference": sum(priced.get(x, 0.0) for x in INFERENCE)}


def _loss(recs: list[tuple[StepRecord, StepShapes]], run: RunData, hw: HardwareSpec) -> float:
    err = []
    for rec, shapes in recs:
        pred = _with_inference(price_stages(run, shapes, hw))
        for name, obs in rec.stages.items():
            if name in pred and pred[name] > 0 and obs > 1e-5:
                err.append(math.log(pred[name] / obs))
    return float(np.mean(np.square(err))) if err else 0.0


def nelder_mead(f, x0: np.ndarray, step: float = 0.5, iters: int = 400, tol: float = 1e-10) -> np.ndarray:
    """Minimise f from x0 with the Nelder-Mead simplex (reflect 1, expand 2, contract 0.5, shrink 0.5).

    Why not scipy.optimize: the loss is a discrete-event replay (no gradients, so torch's
    optimisers do not apply), this is its only optimiser, and scipy is not otherwise a
    dependency of fuseflow; the textbook simplex is 25 lines and tested on a known minimum.
    """
    pts = [x0] + [x0 + step * e for e in np.eye(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        centroid = np.mean(pts[:-1], axis=0)
        refl = centroid + (centroid - pts[-1])
        fr = f(refl)
        if fr < vals[0]:
            exp = centroid + 2.0 * (centroid - pts[-1])
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[int(np.argmin(vals))]


def fit(
    run: RunData, hw: HardwareSpec, recs: list[StepRecord] | None = None, shapes: list[StepShapes] | None = None,
    on_start: Callable[[], None] | None = None,
) -> HardwareSpec:  # fmt: skip
    """The hardware spec with efficiency factors fitted to `recs` (default: every step).

    `shapes` (one per record, as `step_shapes` builds them) lets a caller that also
    predicts the same steps build each step's shapes once; by default they are built here.
    ``on_start`` is called after each of the `FIT_STARTS` starts (a progress bar's tick).
    """
    recs = recs or run.steps
    # Shapes do not depend on the factors: build them once, not on each of ~10^4 evaluations.
    if shapes is None:
        shapes = [step_shapes(run, r) for r in recs]
    elif len(shapes) != len(recs):
        raise ValueError(f"shapes must hold one StepShapes per step record: got {len(shapes)} for {len(recs)} records")
    shaped = list(zip(recs, shapes, strict=True))
    names = list(FACTORS)
    lo = np.log([FACTORS[k][0] for k in names])
    hi = np.log([FACTORS[k][1] for k in names])

    def spec(x: np.ndarray) -> HardwareSpec:
        vals = np.exp(np.clip(x, lo, hi))
        return hw.with_efficiency(**dict(zip(names, vals.tolist(), strict=True)))

    x0 = np.log([getattr(hw.efficiency, k) for k in names])
    # Several starts: on a tiny model, "latency-dominated" and "compute-dominated" are two
    # basins, and one start fell into the worse one (log-loss 0.237 vs 0.109 on a default
    # run). Starts: the spec's own factors, per-layer latency near zero, MFUs near one.
    starts = [x0]
    for alt in ALT_STARTS:
        x = x0.copy()
        for key, value in alt.items():
            x[names.index(key)] = math.log(value)
        starts.append(x)
    found = []
    for start in starts:
        x = nelder_mead(lambda x: _loss(shaped, run, spec(x)), start)
        x = nelder_mead(lambda x: _loss(shaped, run, spec(x)), x, step=0.1)  # restart: escapes early collapse
        found.append((_loss(shaped, run, spec(x)), x))
        if on_start is not None:
            on_start()
    # Latency and MFU trade off along a flat valley, so another start replaces the first
    # only when its fit is clearly better (20% lower loss), not by noise-level amounts.
    best_loss, best = found[0]
    for loss, x in found[1:]:
        if loss < 0.8 * best_loss:
            best_loss, best = loss, x
    return spec(best)


def predict_run(run: RunData, hw: HardwareSpec) -> dict:
    """Median step seconds of `run`, measured and predicted with `hw`'s efficiency factors."""
    pred = float(np.median([predict_step(run, step_shapes(run, r), hw) for r in run.steps]))
    meas = float(np.median([r.step_seconds for r in run.steps]))
    return {"measured": meas, "predicted": pred, "relative_error": (pred - meas) / meas}


def calibrate(run_dir: str | Path, hardware: str = "cpu", predict_dir: str | Path | None = None,
              on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Fit on all steps and predict the median step time; also fit on even steps, test on odd ones.

    ``on_progress(done, total)`` counts fit starts (`FIT_STARTS` per fit): the CLI's progress
    bar, since a 60-step run takes about half a minute to fit.

    With `predict_dir`, the factors fitted on `run_dir` also predict another run (a
    different workload on the same machine): the test that the cost model, not the
    fit, carries the prediction.
    """
    run = load_run(run_dir)
    base = get_hardware(hardware)
    # One build per step serves both fits and every prediction below (shapes do not
    # depend on the factors); rebuilding them per use tripled the work outside the fit.
    shapes = [step_shapes(run, r) for r in run.steps]
    held_out = len(run.steps) >= 4  # enough steps to fit on the even ones and test on the odd ones
    total, done = FIT_STARTS * (2 if held_out else 1), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done, total)

    fitted = fit(run, base, shapes=shapes, on_start=tick)
    stages = [price_stages(run, sh, fitted) for sh in shapes]
    preds = [predict_step(run, sh, fitted, st) for sh, st in zip(shapes, stages, strict=True)]
    measured = [r.step_seconds for r in run.steps]
    med_pred, med_meas = float(np.median(preds)), float(np.median(measured))
    out = {
        "run_dir": str(run_dir), "hardware": hardware, "steps": len(run.steps), "model_params": run.model.params,
        "mode": run.mode.mode, "rollout_workers": run.mode.workers,
        "fitted_efficiency": {k: float(f"{v:.6g}") for k, v in asdict(fitted.efficiency).items()},
        "median_step_seconds": {"measured": med_meas, "predicted": med_pred,
                                "relative_error": (med_pred - med_meas) / med_meas},
        "stages_median_seconds": {},
    }  # fmt: skip
    for name in STAGES:
        obs = [r.stages[name] for r in run.steps if name in r.stages]
        if obs:
            pred = [_with_inference(st).get(name, 0.0) for r, st in zip(run.steps, stages, strict=True)
                    if name in r.stages]
            out["stages_median_seconds"][name] = {"measured": float(np.median(obs)), "predicted": float(np.median(pred))}
    if held_out:
        train_recs, test_recs = run.steps[0::2], run.steps[1::2]
        held = fit(run, base, train_recs, shapes[0::2], on_start=tick)
        p = float(np.median([predict_step(run, sh, held) for sh in shapes[1::2]]))
        m = float(np.median([r.step_seconds for r in test_recs]))
        out["held_out"] = {"fit_on": "even steps", "test_on": "odd steps", "measured": m, "predicted": p,
                           "relative_error": (p - m) / m}  # fmt: skip
    if predict_dir is not None:
        other = load_run(predict_dir, need_trace=False)
        out["other_run"] = {"run_dir": str(predict_dir), "steps": len(other.steps), **predict_run(other, fitted)}
    return out
