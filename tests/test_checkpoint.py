"""Checkpoints: pickle-free optimizer round trip, atomic directories, clear errors."""

import pytest
import torch

from fuseflow.checkpoint import (
    CheckpointWriteError,
    checkpoint_steps,
    checkpoints_to_keep,
    cuda_states,
    find_checkpoint,
    latest_checkpoint,
    load_optimizer_state,
    prune_checkpoints,
    read_state,
    save_checkpoint,
    save_optimizer_state,
)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def save_pretrained(self, path):
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict(), str(path / "model.safetensors"))


def _trained_opt(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model.lin(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_optimizer_round_trip_is_exact(tmp_path):
    torch.manual_seed(0)
    m = _Tiny()
    opt = _trained_opt(m)
    save_optimizer_state(opt.state_dict(), tmp_path / "opt")
    m2 = _Tiny()
    m2.load_state_dict(m.state_dict())
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    opt2.load_state_dict(load_optimizer_state(tmp_path / "opt"))
    x = torch.randn(4, 3)
    for model, o in ((m, opt), (m2, opt2)):
        model.lin(x).pow(2).sum().backward()
        o.step()
    assert opt2.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob("*.pkl"))


def _writers(model, opt):
    # The trainer's path: each worker group writes its own model and optimizer into the directory.
    return [lambda d: model.save_pretrained(d / "actor"),
            lambda d: save_optimizer_state(opt.state_dict(), d / "optim_actor")]


def test_checkpoint_is_atomic_and_latest_points_to_it(tmp_path):
    m = _Tiny()
    opt = _trained_opt(m)
    assert latest_checkpoint(tmp_path) is None
    p1 = save_checkpoint(tmp_path, 1, {"cursor": 5}, _writers(m, opt))
    p2 = save_checkpoint(tmp_path, 2, {"cursor": 9}, _writers(m, opt))
    assert latest_checkpoint(tmp_path) == p2 and find_checkpoint(tmp_path, 1) == p1
    assert read_state(p2)["cursor"] == 9 and read_state(p1)["step"] == 1
    for name in ("actor/model.safetensors", "optim_actor.safetensors", "optim_actor.json", "rng.safetensors"):
        assert (p2 / name).is_file(), name
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if ".tmp" in p.name]
    # A half-written directory from a crash is ignored: only renamed ones count.
    (tmp_path / "checkpoints" / ".step_3.tmp-123").mkdir()
    assert latest_checkpoint(tmp_path) == p2
    with pytest.raises(FileNotFoundError, match="have: step_1, step_2"):
        find_checkpoint(tmp_path, 7)


def test_failing_writer_leaves_the_previous_checkpoint_latest(tmp_path):
    m = _Tiny()
    opt = _trained_opt(m)
    p1 = save_checkpoint(tmp_path, 1, {"cursor": 5}, _writers(m, opt))

    def crash(d):
        (d / "partial.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, {"cursor": 9}, [*_writers(m, opt), crash])
    assert latest_checkpoint(tmp_path) == p1 and not (tmp_path / "checkpoints" / "step_2").exists()


def test_a_full_disk_leaves_the_previous_checkpoint_and_says_so(tmp_path):
    import errno

    m = _Tiny()
    opt = _trained_opt(m)
    p1 = save_checkpoint(tmp_path, 1, {"cursor": 5}, _writers(m, opt))

    def full(d):
        (d / "partial.bin").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteError, match=r"checkpoint step_2 could not be written: no space left .*; "
                                                   r"checkpoint step_1 is intact\. .*resume with") as e:
        save_checkpoint(tmp_path, 2, {"cursor": 9}, [*_writers(m, opt), full])
    assert "\n" not in str(e.value)
    assert latest_checkpoint(tmp_path) == p1 and read_state(p1)["cursor"] == 5
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]  # no partial dir
    # A Ray worker reports the same disk error as text inside a WorkerFailure.
    from fuseflow.controller.group import WorkerFailure

    def remote_full(d):
        raise WorkerFailure("actor", 0, "save", "OSError: [Errno 28] No space left on device: 'x'")

    with pytest.raises(CheckpointWriteError, match="checkpoint step_1 is intact"):
        save_checkpoint(tmp_path, 2, {"cursor": 9}, [remote_full])


@pytest.mark.parametrize("keep, evals, expect", [
    (None, [], [1, 2, 3, 4, 5]),
    (2, [], [4, 5]),
    (2, [{"step": 2, "accuracy": 0.9}, {"step": 4, "accuracy": 0.7}], [2, 4, 5]),  # last 2 plus the best
    (1, [{"step": 1, "accuracy": 0.5}, {"step": 3, "accuracy": 0.5}], [3, 5]),  # a tie keeps the later
    (2, [{"step": 5, "accuracy": 0.9}, {"step": 6, "accuracy": 1.0}], [4, 5]),  # step 6 has no checkpoint
])
def test_retention_keeps_the_last_k_and_the_best(keep, evals, expect):
    assert sorted(checkpoints_to_keep([1, 2, 3, 4, 5], keep, evals)) == expect


def test_prune_deletes_only_complete_old_checkpoints(tmp_path):
    m = _Tiny()
    opt = _trained_opt(m)
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, {"cursor": step}, _writers(m, opt))
    assert prune_checkpoints(tmp_path, 1, [{"step": 2, "accuracy": 1.0}]) == [1, 3]
    assert checkpoint_steps(tmp_path) == [2, 4] and latest_checkpoint(tmp_path).name == "step_4"
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_copy_model_dir_links_cache_files_and_copies_user_models(tmp_path):
    """A run's reference links the files of fuseflow's cache but copies a user's own model directory."""
    from fuseflow.checkpoint import copy_model_dir

    cache = tmp_path / "cache"
    cached = cache / "sft" / "abc"
    user = tmp_path / "my-model"
    for d in (cached, user):
        (d / "sub").mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"weights")
        (d / "sub" / "tokenizer.json").write_text("{}")
    copy_model_dir(cached, tmp_path / "ref1", cache)
    copy_model_dir(user, tmp_path / "ref2", cache)
    for name in ("model.safetensors", "sub/tokenizer.json"):
        assert (tmp_path / "ref1" / name).stat().st_ino == (cached / name).stat().st_ino
        assert (tmp_path / "ref2" / name).stat().st_ino != (user / name).stat().st_ino
        assert (tmp_path / "ref2" / name).read_bytes() == (user / name).read_bytes()
    # Saving into the user's directory again (same inode, truncated) leaves the run's copy as it was.
    with open(user / "model.safetensors", "wb") as f:
        f.write(b"new")
    assert (tmp_path / "ref2" / "model.safetensors").read_bytes() == b"weights"


def test_cuda_generator_states_come_back_in_device_order_past_ten_devices():
    # Keys sorted as text would put cuda10 and cuda11 between cuda1 and cuda2 and restore them on the wrong GPUs.
    tensors = {"torch": torch.tensor([99])} | {f"cuda{i}": torch.tensor([i]) for i in (11, 2, 10, 0, 1, 9, 3, 4, 5, 6, 7, 8)}
    assert [int(t) for t in cuda_states(tensors)] == list(range(12))
    assert cuda_states({"torch": torch.tensor([1])}) == []
