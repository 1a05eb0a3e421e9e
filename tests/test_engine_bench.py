"""The `bench rollout` command surface and its workloads (a tiny quick run; the real numbers are in
docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from fuseflow.rollout.bench import long_tail_lengths, make_workload, register


def test_long_tail_lengths_are_long_tailed_and_reproducible() -> None:
    lengths = long_tail_lengths(400, median=32, sigma=1.1, lo=2, hi=512, seed=0)
    assert lengths == long_tail_lengths(400, median=32, sigma=1.1, lo=2, hi=512, seed=0)
    srt = sorted(lengths)
    assert 24 <= srt[200] <= 40 and srt[int(0.99 * 400)] / srt[200] >= 8 and min(lengths) >= 2 and max(lengths) <= 512


def test_workloads_have_the_promised_shapes() -> None:
    uniform, info = make_workload("uniform", quick=True)
    assert len({r.params.max_new_tokens for r in uniform}) == 1 and info["p99_over_p50"] == 1.0
    groups, info = make_workload("groups", quick=True)
    assert all(len(r.prompt_ids) == 200 for r in groups)
    by_group: dict[int, set] = {}
    for r in groups:
        by_group.setdefault(r.group_id, set()).add(tuple(r.prompt_ids))
    assert all(len(v) == 1 for v in by_group.values()) and len(groups) == 8 * len(by_group)
    assert len({r.params.seed for r in groups}) == len(groups)
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("bursty", quick=True)


def test_bench_rollout_command_writes_the_json_schema(tmp_path) -> None:
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # a group with one command keeps the command name on the command line
        pass

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["rollout", "--out", str(out), "--model", "tiny", "--quick", "--threads", "1",
                                      "--timer", "cpu"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["model"] == "tiny" and data["device"].startswith("cpu")
    assert set(data["workloads"]) == {"uniform", "long_tail", "groups"}
    for w in data["workloads"].values():
        assert w["speedup"] == pytest.approx(w["fuseflow_tok_s"] / w["hf_tok_s"]) == pytest.approx(w["speedup_cpu"])
        assert w["timer"] == "cpu" and len(w["fuseflow_wall_s"]) == len(w["hf_cpu_s"]) == 1
        assert w["fuseflow_tok_s"] > 0 and w["hf_tok_s"] > 0
        assert w["speedup_torch_linear"] == pytest.approx(w["fuseflow_torch_linear_tok_s"] / w["hf_tok_s"])
    groups = data["workloads"]["groups"]
    assert groups["prefill_tokens_computed"] * 8 == groups["prefill_tokens_requested"]
    bad = CliRunner().invoke(app, ["rollout", "--out", str(out), "--model", "huge"])
    assert bad.exit_code == 2 and "tiny or small" in bad.output
    bad = CliRunner().invoke(app, ["rollout", "--out", str(out), "--timer", "gpu"])
    assert bad.exit_code == 2 and "wall or cpu" in bad.output


def test_bench_rollout_backends_option() -> None:
    from fuseflow.rollout.bench import parse_backends, summary_line

    assert parse_backends("hf,engine") == ("engine", "hf")  # the bench's order, whatever the given one
    with pytest.raises(ValueError, match="choose from engine, vllm, hf"):
        parse_backends("engine,sglang")
    line = summary_line("uniform", {"fuseflow_tok_s": 10.0, "vllm_tok_s": 20.0, "vllm_over_engine": 2.0})
    assert "fuseflow     10.0" in line and "vllm     20.0" in line and "vllm_over_engine 2.00x" in line
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:
        pass

    bad = CliRunner().invoke(app, ["rollout", "--out", "x.json", "--backends", "engine,sglang"])
    assert bad.exit_code == 2 and "choose from engine, vllm, hf" in bad.output
    bad = CliRunner().invoke(app, ["rollout", "--out", "x.json", "--dtype", "float16"])
    assert bad.exit_code == 2 and "float32 or bfloat16" in bad.output


def test_bench_rollout_takes_a_pretrained_model_directory(tmp_path) -> None:
    from fuseflow.models import CausalLM, ModelConfig
    from fuseflow.rollout.bench import VOCAB, load_model

    saved = CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=VOCAB + 10), seed=3)
    saved.save_pretrained(tmp_path / "big")
    got = load_model(str(tmp_path / "big"))
    assert got.config.vocab_size == VOCAB + 10
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), saved.state_dict().values(), strict=True))
    CausalLM.from_config(ModelConfig.preset("tiny", vocab_size=100), seed=0).save_pretrained(tmp_path / "small_vocab")
    with pytest.raises(ValueError, match=r"its vocabulary \(100\) is smaller than the workloads' prompt ids"):
        load_model(str(tmp_path / "small_vocab"))
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_model("huge")
