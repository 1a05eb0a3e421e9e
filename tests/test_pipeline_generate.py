"""Pipelined generation (Pipe-RLHF) on 2 gloo stage processes: token-identical to the engine."""

from __future__ import annotations

import pytest
import torch

from fuseflow.models.config import ModelConfig
from fuseflow.rollout.base import SamplingParams
from fuseflow.rollout.engine import Engine
from fuseflow.rollout.sampler import make_requests
from fuseflow.schedule.pipeline.generate import generate_command, split_groups
from fuseflow.schedule.pipeline.train import ModelSpec, PipelineTrainer

SPEC = ModelSpec("actor", ModelConfig.preset("tiny", vocab_size=40), seed=5)


def test_split_groups():
    assert split_groups(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_groups(2, 3) == [[0], [1]]


def test_pipelined_generation_is_token_identical_to_the_engine():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 40, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(5)]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, stop_token_ids=(3,))
    reqs = make_requests(prompts, params, 2, seed=7)
    ref = {s.uid: s for s in Engine(SPEC.build()).generate(reqs)}
    assert {s.finish_reason for s in ref.values()} == {"stop", "length"}  # both ways of finishing are exercised
    with PipelineTrainer({"A": SPEC}, 2, timeout=30) as pt:
        for groups, overlap in ((1, True), (2, True), (3, True), (2, False)):
            first, last = pt.procs.call(generate_command, (reqs, 0, groups, 30, overlap))
            assert first[0] == []
            assert [s.uid for s in last[0]] == [r.uid for r in reqs]
            for s in last[0]:
                want = ref[s.uid]
                assert (s.response_ids, s.finish_reason) == (want.response_ids, want.finish_reason), groups
                assert s.logprobs == pytest.approx(want.logprobs, abs=1e-5)
