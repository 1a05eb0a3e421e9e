"""fuseflow's AdamW (torch's fused kernel where it can) and `fuseflow bench optimizer`."""

import json

import pytest
import torch
from typer.testing import CliRunner

from fuseflow.bench.optimizer import run_optimizer_bench
from fuseflow.cli import app
from fuseflow.workers.optim import adamw


def naive_adamw(p: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, b1: float, b2: float,
                eps: float = 1e-8) -> torch.Tensor:
    """AdamW written out in float64 (decoupled decay, bias-corrected moments), one step per gradient."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    return p


def test_adamw_is_fused_on_cpu_and_matches_adamw_written_out():
    torch.manual_seed(0)
    start = torch.randn(5, 7)
    grads = [torch.randn(5, 7) for _ in range(6)]
    p = torch.nn.Parameter(start.clone())
    opt = adamw([p], 0.05, 0.1)
    assert opt.defaults["fused"] is True  # torch's fused kernel, not the per-tensor loop
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = naive_adamw(start, grads, 0.05, 0.1, 0.9, 0.95)
    assert not torch.equal(p.detach(), start)
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-6, atol=1e-6)
    # and torch's default implementation agrees to within float32 rounding
    q = torch.nn.Parameter(start.clone())
    ref = torch.optim.AdamW([q], lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))
    for g in grads:
        q.grad = g.clone()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_adamw_state_round_trips_through_a_default_adamw():
    """A checkpoint's optimizer state has the same keys and shapes whichever implementation wrote it."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = adamw([p], 0.1)
    p.grad = torch.full((3,), 0.5)
    opt.step()
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    plain.load_state_dict(opt.state_dict())
    assert set(plain.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bench_optimizer_times_both_arms_on_the_same_gradients():
    r = run_optimizer_bench(["tiny"], 2, "cpu", 64)
    (s,) = r["shapes"]
    assert s["fuseflow_implementation"] == "fused"
    assert s["parameters"] > 700_000 and s["tensors"] > 10
    assert len(s["default_seconds"]) == len(s["fuseflow_seconds"]) == 2
    assert all(t > 0 for t in s["default_seconds"] + s["fuseflow_seconds"])
    assert s["time_ratio_fuseflow_vs_default"] > 0
    # the same start, gradients and steps: the weights agree to rounding, and the steps did move them
    assert s["max_abs_weight_difference"] < 1e-5 * s["max_abs_weight"]


@pytest.mark.parametrize("args,needle", [(["--shape", "huge"], "--shape 'huge': unknown"),
                                         (["--steps", "3"], "--steps must be an even number")])
def test_bench_optimizer_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "optimizer", *args, "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert needle in res.output and not out.exists()


def test_bench_optimizer_cli_writes_json(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "optimizer", "--shape", "tiny", "--steps", "2", "--vocab", "64",
                                   "--device", "cpu", "-o", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["benchmark"] == "adamw_step" and r["shapes"][0]["shape"] == "tiny"


def test_a_checkpoint_resumes_with_the_implementation_that_wrote_it(tmp_path):
    """The param groups in the checkpoint carry ``fused``: a run resumes with the kernel it trained with (an older
    checkpoint, written by torch's default loop, keeps the loop), so resume stays exact."""
    from fuseflow.checkpoint import load_optimizer_state, save_optimizer_state

    def stepped(opt, p, n):
        for _ in range(n):
            p.grad = torch.full_like(p, 0.3)
            opt.step()

    for fused_then in (True, None):
        p = torch.nn.Parameter(torch.arange(4.0))
        opt = adamw([p], 0.1) if fused_then else torch.optim.AdamW([p], lr=0.1, weight_decay=0.0, betas=(0.9, 0.95))
        stepped(opt, p, 2)
        save_optimizer_state(opt.state_dict(), tmp_path / f"optim_{fused_then}")
        q = torch.nn.Parameter(p.detach().clone())
        resumed = adamw([q], 0.1)
        resumed.load_state_dict(load_optimizer_state(tmp_path / f"optim_{fused_then}"))
        assert resumed.param_groups[0]["fused"] is fused_then
        stepped(opt, p, 2)
        stepped(resumed, q, 2)
        assert torch.equal(p.detach(), q.detach())  # bitwise: the same kernel before and after the resume
