"""Elastic rollout (RLHFless): each step's replica count and assignment, from predicted lengths.

``ReplicaChooser`` carries out the decisions of ``fuseflow.policy`` for the pooled strategies:
predict each request's response length, price every replica count with the decode cost fitted to
the engines' measured steps, take the cheapest count within the slowdown budget, and deal the
prompt groups to that many workers by predicted length. After the step it records the actual
lengths (the predictor's history) and how far off the prediction was.
"""

from __future__ import annotations

from fuseflow.policy.elastic import (
    DecodeCost,
    ReplicaOption,
    cheapest_within,
    fit_decode_cost,
    replica_seconds,
)
from fuseflow.policy.lengths import LengthPredictor, assign_by_length
from fuseflow.rollout.base import RolloutRequest, Sample

PRIOR_DECODE = DecodeCost(0.01, 0.0005)  # the decode cost before the engines measured any step


class ReplicaChooser:
    """Per-step replica count and assignment; ``info`` holds the step's ``elastic/*`` metrics.

    ``rest`` is the last step's seconds outside generation (the strategy sets it), the base of the
    slowdown budget; ``default_length`` is the prediction before any step was observed.
    """

    def __init__(self, schedule, default_length: float):
        self.slowdown = schedule.elastic_slowdown
        self.predictor = LengthPredictor(schedule.predictor_window, default_length)
        self.info: dict[str, float] = {}
        self.rest = 0.0
        self.predicted: dict[int, float] = {}  # uid -> predicted length of the step being generated

    def shards(self, requests: list[RolloutRequest], pool) -> list[list[RolloutRequest]]:
        """The requests per worker of ``pool`` (empty shards for the workers this step leaves out)."""
        pred = self.predictor.predict([tuple(r.prompt_ids) for r in requests])
        groups = [r.group_id for r in requests]
        log = list(pool.step_log)
        cost = fit_decode_cost([r for r, _ in log], [t for _, t in log], PRIOR_DECODE)
        slots = pool.config.max_num_seqs
        options = []
        for w in range(1, len(pool) + 1):
            assign = assign_by_length(pred, groups, w)
            times = [replica_seconds([pred[i] for i in a], slots, cost) for a in assign if a]
            options.append(ReplicaOption(w, max(times), sum(times), assign))
        choice = cheapest_within(options, self.slowdown, rest=self.rest)
        self.info = {"elastic/replicas": float(sum(1 for a in choice.detail if a)),
                     "elastic/predicted_seconds": choice.seconds,
                     "elastic/predicted_length_mean": sum(pred) / len(pred)}
        self.predicted = dict(zip([r.uid for r in requests], pred, strict=True))
        shards = [[requests[i] for i in a] for a in choice.detail]
        return shards + [[] for _ in range(len(pool) - len(shards))]

    def observe(self, requests: list[RolloutRequest], done: list[Sample]) -> None:
        """Record the step's actual lengths for the predictor, and how far the prediction was off."""
        prompt = {r.uid: tuple(r.prompt_ids) for r in requests}
        actual = {x.uid: len(x.response_ids) for x in done}
        err = [abs(self.predicted[u] - n) for u, n in actual.items()]
        self.info["elastic/length_abs_error"] = sum(err) / len(err)
        self.info["elastic/length_actual_mean"] = sum(actual.values()) / len(actual)
        self.predictor.observe([prompt[u] for u in actual], list(actual.values()))
