"""Bad inputs a user can give fuseflow, each with the one line it must answer: the source of docs/reliability.md.

Each case is a CLI command line (``{tmp}`` stands for a scratch directory made for it), an optional
set-up writing the files it needs and an optional patch (a disk that fills). ``run_case`` runs it
in-process through typer's CliRunner and returns what the user saw; ``tests/test_reliability.py``
checks every case and that the doc is current. Regenerate the doc with:

    PYTHONPATH=src python tests/reliability_cases.py docs/reliability.md
"""

from __future__ import annotations

import errno
import json
import socket
import sys
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

# A tiny run that reaches the first RL step in seconds: no SFT, a model written by the set-up.
RUN = ["sft.enabled=false", "model.path={tmp}/model", "trainer.steps=2", "trainer.prompts_per_step=2",
       "algorithm.group_size=2", "trainer.mini_batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_size=4",
       "task.eval_size=4", "trainer.save_every=1"]
FILE_TASK = ["task.name=file", "task.path={tmp}/data.jsonl", "task.reward_fn={tmp}/rw.py:score"]

REWARDS = {
    "raises": "def score(prompt, response, answer):\n    raise KeyError('answer')\n",
    "string": "def score(prompt, response, answer):\n    return 'correct'\n",
    "inf": "def score(prompt, response, answer):\n    return float('inf')\n",
    "slow": "import time\ndef score(prompt, response, answer):\n    time.sleep(30)\n    return 1.0\n",
    "crash": "import os\ndef score(prompt, response, answer):\n    os._exit(9)\n",
    "short_batch": "def score(prompts, responses, answers):\n    return [1.0]\n",
    "syntax": "def score(prompt, response, answer)\n    return 1.0\n",
    "ok": "def score(prompt, response, answer):\n    return float(response.strip() == answer)\n",
}


@dataclass
class Case:
    """One bad input: what is wrong, the command line, and what to prepare."""

    what: str
    args: list[str]
    setup: Callable[[Path], None] | None = None
    patch: Callable[[pytest.MonkeyPatch], None] | None = None
    kind: str = "config"
    extra: dict = field(default_factory=dict)


def model_dir(tmp: Path) -> None:
    """A tiny causal LM with the built-in char tokenizer's vocabulary at ``tmp/model``."""
    import torch

    from fuseflow.data.tokenizer import build_char_tokenizer
    from fuseflow.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    CausalLM(ModelConfig.preset("tiny", vocab_size=len(tok))).save_pretrained(tmp / "model")


def data_file(tmp: Path, reward: str = "ok") -> None:
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "rw.py").write_text(REWARDS[reward])


def run_with(reward: str) -> Callable[[Path], None]:
    return lambda tmp: (model_dir(tmp), data_file(tmp, reward))


def write(name: str, text: str | bytes, also_model: bool = False) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        if also_model:
            model_dir(tmp)
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
    return setup


def closed_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


def disk_full_on_second_save(mp: pytest.MonkeyPatch) -> None:
    import fuseflow.checkpoint as ckpt

    real, calls = ckpt._fsync_tree, []

    def fsync(path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path)

    mp.setattr(ckpt, "_fsync_tree", fsync)


def _listener(tmp: Path) -> None:
    # A port where something listens that is not Ray (kept open for the case's duration).
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    _OPEN.append(s)
    (tmp / "port").write_text(str(s.getsockname()[1]))


_OPEN: list[socket.socket] = []
T = ["train", "--output", "{tmp}/run", "cache_dir={tmp}/cache"]

CASES: list[Case] = [
    # ------------------------------------------------------------ config keys and values
    Case("misspelt key", [*T, "trainer.stepz=1"]),
    Case("unknown section", [*T, "nosuchsection.x=1"]),
    Case("value where a section belongs", [*T, "trainer=3"]),
    Case("out-of-range value", [*T, "trainer.steps=0"]),
    Case("wrong type", [*T, "trainer.steps=abc"]),
    Case("unknown algorithm", [*T, "algorithm.name=foo"]),
    Case("probability above 1", [*T, "rollout.top_p=1.5"]),
    Case("micro-batch does not divide the mini-batch", [*T, "trainer.micro_batch_size=100"]),
    Case("mini-batch does not divide the samples per step", [*T, "trainer.prompts_per_step=3"]),
    Case("one sample per prompt with a group baseline", [*T, "algorithm.group_size=1"]),
    Case("KL in the reward with a sequence-level estimator", [*T, "algorithm.kl_in_reward=true"]),
    Case("safe_ppo without a cost", [*T, "algorithm.name=safe_ppo"]),
    Case("overlong buffer as long as the response", [*T, "algorithm.overlong_buffer=16"]),
    Case("adaptive KL from a zero coefficient", [*T, "algorithm.name=dapo", "algorithm.kl_target=0.1"]),
    Case("reward function given to a built-in task", [*T, "task.reward_fn=my_rewards.py:score"]),
    Case("cost function given to a built-in task", [*T, "task.cost_fn=my_costs.py:cost"]),
    Case("file task without a data file", [*T, "task.name=file"]),
    Case("file task without a reward", [*T, "task.name=file", "task.path=data.jsonl"]),
    Case("fused mode on Ray without a rollout pool", [*T, "schedule.mode=fused", "backend=ray"]),
    Case("rollout replicas on a role's pool", [*T, "schedule.mode=fused", "schedule.rollout_workers=2", "backend=ray",
                                                "placement.rollout=main"]),
    Case("more rollout replicas than the pool's bundles", [*T, "schedule.mode=elastic", "schedule.rollout_workers=3",
                                                            "backend=ray", "placement.rollout=rollout",
                                                            "pools.rollout.workers_per_node=2"]),
    Case("async mode with the on-policy loss", [*T, "schedule.mode=async", "algorithm.policy_loss=ppo"]),
    Case("migration threshold not a fraction", [*T, "schedule.migration_threshold=1.5"]),
    Case("elastic with one rollout worker", [*T, "schedule.mode=elastic"]),
    Case("elastic with a negative slowdown budget", [*T, "schedule.mode=elastic", "schedule.rollout_workers=2",
                                                     "schedule.elastic_slowdown=-0.1"]),
    Case("length predictor window below 1", [*T, "schedule.predictor_window=0"]),
    Case("negative staleness bound", [*T, "schedule.mode=async", "schedule.max_staleness=-1"]),
    Case("data parallelism on the local backend", [*T, "actor.dp=2"]),
    Case("dp that does not divide the mini-batch", [*T, "backend=ray", "actor.dp=3"]),
    Case("zero reward timeout", [*T, "reward.timeout_s=0"]),
    Case("negative reward workers", [*T, "reward.workers=-1"]),
    Case("keeping zero checkpoints", [*T, "trainer.keep_checkpoints=0"]),
    Case("negative restart budget", [*T, "trainer.max_restarts=-1"]),
    Case("override without '='", [*T, "trainer.steps"]),
    Case("actor.pp of 0", [*T, "actor.pp=0"]),
    Case("critic.pp for an algorithm without a critic", [*T, "algorithm.name=grpo", "critic.pp=2"]),
    Case("actor.pp and critic.pp differ under PPO", [*T, "algorithm.name=ppo", "actor.pp=2"]),
    Case("actor.pp with LoRA", [*T, "actor.pp=2", "model.lora.enabled=true"]),
    Case("actor.pp with backend=ray", [*T, "actor.pp=2", "backend=ray"]),
    Case("actor.pp_split of the wrong length", [*T, "actor.pp=2", "actor.pp_split=[1,1,2]"]),
    Case("schedule.pipeline_memory_cap below one micro-batch", [*T, "schedule.pipeline_memory_cap=0.5"]),
    Case("rollout.pipeline_stages of 3", [*T, "rollout.pipeline_stages=3"]),
    Case("rollout.pipeline_stages with another rollout backend", [*T, "rollout.pipeline_stages=2",
                                                                  "rollout.backend=sampler"]),
    Case("actor.pp larger than the model's layers", [*T, *RUN, "actor.pp=5"], setup=model_dir, kind="file"),
    Case("unknown preset", [*T, "--preset", "nope"]),
    Case("unknown device", [*T, *RUN, "device=tpu"], setup=model_dir, kind="file"),
    # ------------------------------------------------------------ files
    Case("--config file missing", [*T, "--config", "{tmp}/missing.yaml"], kind="file"),
    Case("--config file not YAML", [*T, "--config", "{tmp}/c.yaml"], setup=write("c.yaml", "trainer: [1,\n"),
         kind="file"),
    Case("--config file a list", [*T, "--config", "{tmp}/c.yaml"], setup=write("c.yaml", "- trainer\n"), kind="file"),
    Case("--resume of a directory without a run", ["train", "--resume", "{tmp}"], kind="file"),
    Case("--resume with a broken config.yaml", ["train", "--resume", "{tmp}/r"],
         setup=write("r/config.yaml", "trainer: {steps: [\n"), kind="file"),
    Case("--output that already holds a run", [*T[:2], "{tmp}/r"], setup=write("r/checkpoints/latest", "step_1"),
         kind="file"),
    Case("model.path missing", [*T, "model.path={tmp}/nope"], kind="file"),
    Case("model.path config.json not JSON", [*T, "model.path={tmp}/m"], setup=write("m/config.json", "{not json"),
         kind="file"),
    Case("model.path of an unsupported architecture", [*T, "model.path={tmp}/m"],
         setup=write("m/config.json", json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})),
         kind="file"),
    Case("model.path without safetensors weights", [*T, "model.path={tmp}/model"],
         setup=lambda tmp: (model_dir(tmp), (tmp / "model/model.safetensors").rename(tmp / "model/w.bin")),
         kind="file"),
    Case("model.path with a truncated safetensors file", [*T, "model.path={tmp}/model"],
         setup=lambda tmp: (model_dir(tmp), (tmp / "model/model.safetensors").write_bytes(b"\x10\x00\x00")),
         kind="file"),
    Case("model.tokenizer missing", [*T, "model.tokenizer={tmp}/tok"], kind="file"),
    Case("model.tokenizer with tokenizer.json not JSON", [*T, "model.tokenizer={tmp}/tok"],
         setup=write("tok/tokenizer.json", "{oops"), kind="file"),
    Case("reward.model not a reward-model directory", [*T, "reward.model={tmp}/model"], setup=model_dir, kind="file"),
    Case("data file missing", [*T, *RUN, *FILE_TASK[:1], "task.path={tmp}/nope.jsonl", FILE_TASK[2]],
         setup=run_with("ok"), kind="file"),
    Case("data file empty", [*T, *RUN, *FILE_TASK], setup=lambda t: (run_with("ok")(t), write("data.jsonl", "")(t)),
         kind="file"),
    Case("data file with a bad JSON line", [*T, *RUN, *FILE_TASK],
         setup=lambda t: (run_with("ok")(t), write("data.jsonl", '{"prompt": "a"}\n{"prompt": \n')(t)), kind="file"),
    Case("data rows without a prompt", [*T, *RUN, *FILE_TASK],
         setup=lambda t: (run_with("ok")(t), write("data.jsonl", '{"question": "a"}\n')(t)), kind="file"),
    Case("data file of an unknown format", [*T, *RUN, *FILE_TASK[:1], "task.path={tmp}/d.csv", FILE_TASK[2]],
         setup=lambda t: (run_with("ok")(t), write("d.csv", "prompt\na\n")(t)), kind="file"),
    Case("prompt longer than model.max_prompt_len", [*T, *RUN, *FILE_TASK, "model.max_prompt_len=2"],
         setup=run_with("ok"), kind="file"),
    Case("reward file missing", [*T, *RUN, *FILE_TASK[:2], "task.reward_fn={tmp}/nope.py:score"],
         setup=run_with("ok"), kind="file"),
    Case("reward spec without a function", [*T, *RUN, *FILE_TASK[:2], "task.reward_fn={tmp}/rw.py"],
         setup=run_with("ok"), kind="file"),
    Case("reward file without that function", [*T, *RUN, *FILE_TASK[:2], "task.reward_fn={tmp}/rw.py:nope"],
         setup=run_with("ok"), kind="file"),
    Case("reward file with a syntax error", [*T, *RUN, *FILE_TASK], setup=run_with("syntax"), kind="file"),
    Case("export of a run without checkpoints", ["export", "{tmp}", "{tmp}/out"], kind="file"),
    # ------------------------------------------------------------ user functions at run time
    Case("reward function raises", [*T, *RUN, *FILE_TASK], setup=run_with("raises"), kind="user code"),
    Case("reward function returns a string", [*T, *RUN, *FILE_TASK], setup=run_with("string"), kind="user code"),
    Case("reward function returns inf", [*T, *RUN, *FILE_TASK], setup=run_with("inf"), kind="user code"),
    Case("reward call longer than reward.timeout_s", [*T, *RUN, *FILE_TASK, "reward.timeout_s=1"],
         setup=run_with("slow"), kind="user code"),
    Case("reward function crashes its process (reward.workers=1)", [*T, *RUN, *FILE_TASK, "reward.workers=1"],
         setup=run_with("crash"), kind="user code"),
    Case("batch reward function returns too few values", [*T, *RUN, *FILE_TASK, "reward.batch=true"],
         setup=run_with("short_batch"), kind="user code"),
    # ------------------------------------------------------------ cluster
    Case("ray.address with nothing listening", [*T, *RUN, "backend=ray", "ray.address=127.0.0.1:{port}"],
         setup=model_dir, kind="cluster", extra={"port": "closed"}),
    Case("ray.address of something that is not Ray", [*T, *RUN, "backend=ray", "ray.address=127.0.0.1:{port}",
                                                      "ray.start_timeout_s=2"],
         setup=lambda t: (model_dir(t), _listener(t)), kind="cluster", extra={"port": "listener"}),
    Case("ray.address not HOST:PORT", [*T, *RUN, "backend=ray", "ray.address=headnode"], setup=model_dir,
         kind="cluster"),
    # ------------------------------------------------------------ the disk
    Case("disk fills during the second checkpoint", [*T, *RUN, *FILE_TASK, "trainer.steps=3"], setup=run_with("ok"),
         patch=disk_full_on_second_save, kind="disk"),
]


@dataclass
class Outcome:
    exit_code: int
    stdout: str
    stderr: str
    exception: BaseException | None
    tmp: Path

    def message(self) -> str:
        """The error line with the scratch directory written as TMP (what the doc shows)."""
        return self.stderr.strip().replace(str(self.tmp), "TMP")


def run_case(case: Case, tmp: Path) -> Outcome:
    """Set the case up in ``tmp`` and run its command in-process; returns what the user saw."""
    from typer.testing import CliRunner

    from fuseflow.cli import app

    tmp.mkdir(parents=True, exist_ok=True)
    if case.setup:
        case.setup(tmp)
    port = ""
    if case.extra.get("port") == "closed":
        port = str(closed_port())
    elif case.extra.get("port") == "listener":
        port = (tmp / "port").read_text()
    args = [a.replace("{tmp}", str(tmp)).replace("{port}", port) for a in case.args]
    try:
        with pytest.MonkeyPatch.context() as mp:
            if case.patch:
                case.patch(mp)
            result = CliRunner().invoke(app, args)
    finally:
        while _OPEN:
            _OPEN.pop().close()
    out = Outcome(result.exit_code, result.stdout, result.stderr, result.exception, tmp)
    if port:
        out.stderr = out.stderr.replace(port, "PORT")
    return out


def write_doc(path: Path, rows: list[tuple[Case, str]]) -> None:
    """docs/reliability.md: the table of bad inputs and their exact messages."""
    lines = [
        "# Bad input and what fuseflow answers",
        "",
        "Every row is a bad input a user can give `fuseflow`, run by `tests/test_reliability.py`, which checks",
        "that each one exits with code 2, prints exactly one line on stderr starting with `error:` and no",
        "traceback, and leaves no half-written run directory or cache entry. The messages below are",
        "what that run printed (`TMP` stands for the test's scratch directory, `PORT` for a free port).",
        f"Regenerate this page with `PYTHONPATH=src python tests/reliability_cases.py {path.as_posix()}`.",
        "",
        "Commands are `fuseflow train --output TMP/run cache_dir=TMP/cache ...` unless the row says otherwise;",
        "rows marked *run* add a tiny run (`sft.enabled=false model.path=TMP/model trainer.steps=2 ...`) so that",
        "the failure happens where it would in a real one (at set-up, at the first reward, at a checkpoint).",
        "",
        "| # | kind | bad input | arguments | message (stderr, exit code 2) |",
        "|---|---|---|---|---|",
    ]
    run_args = set(RUN) | set(T)
    for i, (case, message) in enumerate(rows, 1):
        shown = [a for a in case.args if a not in run_args]
        if case.args[0] != "train":
            shown = case.args
        label = ("*run* " if set(RUN) <= set(case.args) else "") + " ".join(shown)
        label = label.replace("{tmp}", "TMP").replace("{port}", "PORT").replace("|", "\\|")
        shown_message = message.replace("|", "\\|")
        lines.append(f"| {i} | {case.kind} | {case.what} | `{label}` | `{shown_message}` |")
    lines += [
        "",
        "Other behaviour of note:",
        "",
        "- A reward function that returns NaN does not stop the run: the step's update is skipped with a warning",
        "  (`train/skipped_update` = 1 in metrics.jsonl).",
        "- A worker process that dies, or a collective that times out, on `backend=ray` restarts the worker groups",
        "  from the last checkpoint up to `trainer.max_restarts` times (default 3 on Ray, 0 locally); past that,",
        "  the run ends with exit code 1 and one line naming the role, rank, last checkpoint and how to resume.",
        "  [recovery.md](recovery.md) records a 200-step Ray run with a worker process killed every 50 steps.",
        "- A pipeline stage process (`actor.pp > 1`) that dies ends the step within seconds with one line naming",
        "  the role, stage and rank and the action it was running (`... failed in actor.pipeline_update: stage",
        "  process rank 1 (actor stage 1, critic stage 0, at action ...) died (exit code -9) during _step`;",
        "  `tests/test_pipeline_trainer.py`), then exit code 1 as above.",
        "- Ctrl-C ends with exit code 130 and names the checkpoint that is intact.",
        "",
    ]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    import tempfile

    out_path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/reliability.md")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i, case in enumerate(CASES):
            outcome = run_case(case, Path(d) / f"case{i}")
            print(f"{i + 1:2d} exit {outcome.exit_code}: {outcome.message()}", file=sys.stderr)
            rows.append((case, outcome.message()))
    write_doc(out_path, rows)
