"""The engine's contract: streaming order, stops, continuous batching without dead rows, the KV
budget, weights and versions, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch

from fuseflow.models import CausalLM, ModelConfig
from fuseflow.rollout.base import RolloutRequest, SamplingParams
from fuseflow.rollout.engine import Engine, EngineConfig, PartialState

V = 41


def _model(seed: int = 0) -> CausalLM:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
    return CausalLM.from_config(cfg, seed=seed).eval()


def _req(uid: int, n_new: int, prompt: list[int] | None = None, **kw) -> RolloutRequest:
    return RolloutRequest(uid, prompt or [1 + uid % 30, 2, 3], SamplingParams(max_new_tokens=n_new, seed=uid, **kw))


def test_generate_streams_each_sample_when_it_finishes() -> None:
    engine = Engine(_model(), EngineConfig(max_num_seqs=4))
    stream = engine.generate([_req(0, 30), _req(1, 3), _req(2, 12)])
    first = next(stream)
    # The short sample arrives while the long one is still being generated, not at the end of the batch.
    assert first.uid == 1 and engine.has_unfinished()
    assert [s.uid for s in stream] == [2, 0]


def test_decode_steps_carry_only_live_rows_and_refill_free_slots() -> None:
    engine = Engine(_model(), EngineConfig(max_num_seqs=3))
    sizes: list[int] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda plan: (sizes.append(len(plan.rows)), forward(plan))[1]
    lengths = [2, 9, 4, 6, 3]
    samples = list(engine.generate([_req(i, n) for i, n in enumerate(lengths)]))
    assert sorted(len(s.response_ids) for s in samples) == sorted(lengths)
    assert max(sizes) == 3 and sizes[-1] == 1  # never more rows than live sequences; the tail runs alone
    # Rows computed = tokens generated: every row of every step produced a token for a live sample.
    assert sum(sizes) == sum(lengths)


def test_admission_waits_for_kv_blocks_within_the_budget() -> None:
    # 4 blocks of 8 tokens: two 3-token prompts growing to 14 tokens need 2 blocks each.
    engine = Engine(_model(), EngineConfig(max_num_seqs=8, kv_budget_tokens=32, block_size=8))
    running: list[int] = []
    step = engine.step

    def counting_step():
        out = step()
        running.append(len(engine.scheduler.running))
        assert engine.blocks.num_free >= 0
        return out

    engine.step = counting_step
    samples = list(engine.generate([_req(i, 11) for i in range(6)]))
    assert len(samples) == 6 and max(running) < 6
    assert engine.blocks.num_free == engine.num_blocks


def test_stop_token_and_stop_string_end_a_sample() -> None:
    class Tok:  # one character per id
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(ord("a") + i % 26) for i in ids)

    model = _model()
    free = next(Engine(model).generate([_req(0, 20, greedy=True)])).response_ids
    stop_tok = free[5]
    engine = Engine(model, tokenizer=Tok())
    by_token = next(engine.generate([_req(0, 20, greedy=True, stop_token_ids=(stop_tok,))]))
    assert by_token.response_ids == free[: free.index(stop_tok) + 1] and by_token.finish_reason == "stop"
    text = Tok().decode(free)
    by_string = next(engine.generate([_req(1, 20, prompt=[1, 2, 3], greedy=True, stop=(text[3:5],))]))
    assert by_string.finish_reason == "stop" and Tok().decode(by_string.response_ids).endswith(text[3:5])
    assert len(by_string.response_ids) <= 5
    capped = next(engine.generate([_req(2, 4, prompt=[1, 2, 3], greedy=True)]))
    assert capped.finish_reason == "length" and len(capped.response_ids) == 4


def test_samples_carry_timestamps_and_the_policy_version() -> None:
    model = _model()
    engine = Engine(model)
    s = next(engine.generate([_req(0, 3)]))
    assert s.policy_version == 0 and s.t_first_token is not None and s.t_finish >= s.t_first_token
    engine.update_weights(7)
    assert next(engine.generate([_req(1, 3)])).policy_version == 7 and engine.policy_version == 7
    engine.update_weights()
    assert engine.policy_version == 8


def test_update_weights_with_a_state_dict_changes_outputs_and_empties_the_prefix_cache() -> None:
    model, other = _model(0), _model(1)
    prompt = list(range(1, 20))
    engine = Engine(model, EngineConfig(block_size=4))
    before = next(engine.generate([_req(0, 8, prompt=prompt, greedy=True)])).response_ids
    engine.update_weights(1, state_dict=other.state_dict())
    after = next(engine.generate([_req(1, 8, prompt=prompt, greedy=True)]))
    want = next(Engine(other).generate([_req(1, 8, prompt=prompt, greedy=True)])).response_ids
    assert after.response_ids == want != before
    assert engine.stats["prefix_cache_hit_tokens"] == 0  # stale KV from the old weights was not reused
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(2, state_dict={"model.norm.weight": torch.ones(32)} | {"x": torch.zeros(1)})


def test_in_process_engine_shares_the_model_parameters() -> None:
    model = _model()
    engine = Engine(model)
    assert engine.runner.model is model
    before = next(engine.generate([_req(0, 6, greedy=True)])).response_ids
    with torch.no_grad():  # a trainer's in-place update is seen without any copy
        model.lm_head.weight.mul_(-1.0)
    engine.update_weights(1)
    assert next(engine.generate([_req(1, 6, prompt=[1, 2, 3], greedy=True)])).response_ids != before


def test_abort_returns_waiting_and_running_samples_and_ignores_unknown_uids() -> None:
    engine = Engine(_model(), EngineConfig(max_num_seqs=1))
    for i in range(3):
        engine.add(_req(i, 10))
    engine.step()
    engine.step()
    partials = engine.abort([0, 2, 99])
    assert sorted(p.uid for p in partials) == [0, 2]
    state = {p.uid: p for p in partials}
    assert len(state[0].response_ids) == 2 and state[0].rng_state is not None
    assert state[2].response_ids == [] and state[2].rng_state is None
    assert [s.uid for s in engine.generate([])] == [1]
    assert [s.uid for s in engine.generate([_req(0, 2), _req(1, 2)])] == [0, 1]  # finished uids can be reused


def test_bad_input_is_rejected_with_a_clear_message() -> None:
    engine = Engine(_model(), EngineConfig(kv_budget_tokens=64, block_size=8))
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.add(RolloutRequest(0, [], SamplingParams()))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 41\)"):
        engine.add(_req(0, 3, prompt=[1, 41]))
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        engine.add(_req(0, 70))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(_model()).add(_req(0, 126))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add(_req(0, 3, stop=("x",)))
    with pytest.raises(ValueError, match="nothing to resume"):
        engine.add(PartialState(_req(0, 2), response_ids=[1, 2], logprobs=[0.0, 0.0]))
    engine.add(_req(5, 3))
    with pytest.raises(ValueError, match="already in this engine"):
        engine.add(_req(5, 3))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop="x")


def test_a_request_as_large_as_the_whole_kv_pool_still_runs() -> None:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      max_position_embeddings=512)
    model = CausalLM.from_config(cfg, seed=0).eval()
    # Half of 800 tokens is the pool: 200 blocks (1% headroom = 2 blocks); the prompt alone needs 199 and
    # the sample all 200. The other half, the decode copy, cannot hold a 400-token row (rounded up to 448),
    # so this row decodes straight from the pool.
    engine = Engine(model, EngineConfig(max_num_seqs=2, kv_budget_tokens=800, block_size=2))
    sample = next(engine.generate([_req(0, 2, prompt=[1] * 398)]))
    assert len(sample.response_ids) == 2 and engine.blocks.num_free == 200


def test_kv_memory_of_pool_and_decode_copy_stays_within_the_budget() -> None:
    model = _model()
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim  # K and V of one token, all layers
    cfg = EngineConfig(max_num_seqs=6, kv_budget_tokens=160, block_size=4)
    engine = Engine(model, cfg)
    lengths = [3, 40, 7, 25, 12, 2, 33, 9]
    peak_copy, done = 0, []
    for r in [_req(i, n) for i, n in enumerate(lengths)]:
        engine.add(r)
    while engine.has_unfinished():
        done += engine.step()
        buf = engine.runner.decode_cache.buf
        copy = 0 if buf is None else buf.numel()
        peak_copy = max(peak_copy, copy)
        assert engine.runner.pool.data.numel() + copy <= cfg.kv_budget_tokens * per_token
    assert sorted(len(s.response_ids) for s in done) == sorted(lengths)
    assert peak_copy > 0 and engine.runner.decode_cache.buf is None  # the copy was used, and freed when idle
