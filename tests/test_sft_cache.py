"""The SFT cache key: it changes with every input that shapes the SFT model, files' contents included."""

import json

from fuseflow import sft
from fuseflow.config import load_config
from fuseflow.sft import sft_cache_dir


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rm_only_file_task(tmp_path):
    # task.name=file with no reward_fn: the reward comes from reward.model alone.
    data = tmp_path / "data.jsonl"
    _write(data, [{"prompt": f"q{i}=", "response": str(i)} for i in range(20)])
    return data, [f"cache_dir={tmp_path / 'cache'}", "task.name=file", f"task.path={data}",
                  f"reward.model={tmp_path / 'rm'}"]


def test_editing_the_data_file_in_place_changes_the_key(tmp_path):
    data, args = _rm_only_file_task(tmp_path)
    before = sft_cache_dir(load_config("default", args))
    assert sft_cache_dir(load_config("default", args)) == before  # same inputs, same key: the cache is reused
    _write(data, [{"prompt": f"q{i}=", "response": str(i + 1)} for i in range(20)])  # same path, new demos
    assert sft_cache_dir(load_config("default", args)) != before


def test_key_ignores_the_reward_model_and_mtime_but_not_reward_code(tmp_path):
    data, args = _rm_only_file_task(tmp_path)
    key = sft_cache_dir(load_config("default", args))
    # SFT never reads the reward model, and a rewrite with the same bytes is the same data.
    assert sft_cache_dir(load_config("default", [*args, f"reward.model={tmp_path / 'other_rm'}"])) == key
    data.write_bytes(data.read_bytes())
    assert sft_cache_dir(load_config("default", args)) == key
    # A reward file picks the best SFT checkpoint by held-out accuracy: its code is part of the key.
    rw = tmp_path / "rw.py"
    rw.write_text("def score(p, r, a):\n    return 1.0\n")
    with_fn = [*args, f"task.reward_fn={rw}:score"]
    key_fn = sft_cache_dir(load_config("default", with_fn))
    rw.write_text("def score(p, r, a):\n    return 0.0\n")
    assert sft_cache_dir(load_config("default", with_fn)) != key_fn


def test_tokenizer_directory_contents_are_in_the_key(tmp_path):
    _, args = _rm_only_file_task(tmp_path)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"v": 1}')
    args = [*args, f"model.tokenizer={tok}"]
    key = sft_cache_dir(load_config("default", args))
    (tok / "tokenizer.json").write_text('{"v": 2}')
    assert sft_cache_dir(load_config("default", args)) != key


def test_big_files_are_keyed_by_size_and_mtime(tmp_path, monkeypatch):
    import os

    data, args = _rm_only_file_task(tmp_path)
    monkeypatch.setattr(sft, "HASH_LIMIT", 0)  # every file counts as big: not read, only stat'ed
    key = sft_cache_dir(load_config("default", args))
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert sft_cache_dir(load_config("default", args)) != key


def test_builtin_tasks_keep_their_key_form(tmp_path):
    # No files to hash: the key is the config digest, seed and version alone, as before file
    # hashing existed, so caches trained by earlier versions are still found.
    cfg = load_config("default", [f"cache_dir={tmp_path}"])
    assert sft_cache_dir(cfg).name == f"{cfg.digest('task', 'model', 'sft')}-s0-v{sft.SFT_VERSION}"


def _warm_start(args: list[str]) -> list[str]:
    """ensure_sft_model in a fresh process (spawned by the test below); its log lines."""
    import torch

    from fuseflow.models.source import run_tokenizer
    from fuseflow.tasks import make_task

    torch.set_num_threads(1)
    cfg = load_config("default", args)
    lines: list[str] = []
    sft.ensure_sft_model(cfg, make_task(cfg.task), run_tokenizer(cfg), torch.device("cpu"), torch.float32,
                         log=lines.append)
    return lines


def test_two_processes_sharing_a_cache_train_the_model_once(tmp_path):
    # Parallel test workers, or two runs at once, share the cache: one trains, the other waits on the
    # lock (or comes after) and reuses the model; the cache holds one finished model.
    import multiprocessing as mp

    args = [f"cache_dir={tmp_path / 'cache'}", "task.train_size=64", "task.eval_size=8", "sft.max_steps=30",
            "sft.eval_every=30", "sft.eval_size=8"]
    with mp.get_context("spawn").Pool(2) as pool:
        logs = pool.map(_warm_start, [args, args])
    trained = [log for log in logs if any("training the warm-start model" in x for x in log)]
    assert len(trained) == 1, logs
    other = logs[1 - logs.index(trained[0])]
    assert any("reusing cached model" in x for x in other), other
    cache = sft_cache_dir(load_config("default", args))
    assert (cache / "sft_curve.json").is_file()
    assert [p.name for p in cache.parent.iterdir() if ".tmp-" in p.name] == []
