"""Checks of the files a config names, before any work: one line naming the setting and the file.

A model directory whose ``config.json`` is not JSON, a tokenizer directory that transformers
cannot load or a safetensors file with a broken header would otherwise surface minutes later
(after SFT) as a library traceback. These checks read only headers and small JSON files, so
they cost milliseconds; the data files and the user's reward function are checked by
``fuseflow.tasks.make_task``, which the run calls first thing.
"""

from __future__ import annotations

from pathlib import Path

from fuseflow.config import Config
from fuseflow.config_tree import ConfigError
from fuseflow.data.files import BadFileError, read_json
from fuseflow.models.source import NAMED_MODELS


def check_inputs(cfg: Config) -> None:
    """Raise ``ConfigError`` (one line) for the first unusable file or directory ``cfg`` names."""
    # A GGUF file or a named model (fuseflow.models.source) is checked when it is converted.
    if cfg.model.path and cfg.model.path not in NAMED_MODELS and not cfg.model.path.endswith(".gguf"):
        check_model_dir(cfg.model.path, "model.path")
    if cfg.model.tokenizer:
        check_tokenizer_dir(cfg.model.tokenizer, "model.tokenizer")
    if cfg.reward.model:
        check_reward_model_dir(cfg.reward.model)


def check_model_dir(path: str, field: str) -> None:
    """A Hugging Face causal-LM directory: a JSON ``config.json`` fuseflow supports and readable safetensors."""
    from fuseflow.models import ModelConfig
    from fuseflow.models.hf_io import CONFIG_NAME, INDEX_NAME, VALUE_MODEL_KEY, WEIGHTS_NAME

    where = f"{field}={path}"
    d = _directory(path, where, "a Hugging Face model directory (config.json + model.safetensors)")
    if not (d / CONFIG_NAME).is_file():
        raise ConfigError(f"{where}: no {CONFIG_NAME} there; expected a Hugging Face model directory")
    hf = _json_object(d / CONFIG_NAME, where)
    if hf.get(VALUE_MODEL_KEY):
        raise ConfigError(f"{where}: holds a fuseflow value (critic or reward) model, not a causal LM")
    try:
        ModelConfig.from_hf_dict(hf)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{where}: {CONFIG_NAME}: {_first_line(e)}") from None
    if (d / WEIGHTS_NAME).is_file():
        shards = [WEIGHTS_NAME]
    elif (d / INDEX_NAME).is_file():
        index = _json_object(d / INDEX_NAME, where)
        if not isinstance(index.get("weight_map"), dict):
            raise ConfigError(f"{where}: {INDEX_NAME} has no 'weight_map' object")
        shards = sorted(set(index["weight_map"].values()))
    else:
        raise ConfigError(f"{where}: no {WEIGHTS_NAME} or {INDEX_NAME} there; only safetensors weights are loaded "
                          "(never pickle .bin); convert with transformers' save_pretrained(safe_serialization=True)")
    for shard in shards:
        _safetensors_header(d / shard, where)


def check_tokenizer_dir(path: str, field: str) -> None:
    """A tokenizer directory transformers loads, with JSON files that parse and an eos token."""
    from fuseflow.data.tokenizer import load_tokenizer

    where = f"{field}={path}"
    d = _directory(path, where, "a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json)")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (d / name).is_file():
            _json_object(d / name, where)
    try:
        load_tokenizer(d)
    except (OSError, ValueError, TypeError, KeyError) as e:
        msg = _first_line(e).removeprefix(f"model.tokenizer: {d}")
        raise ConfigError(f"{where}: cannot load the tokenizer: {msg.strip(' :')}") from None


def check_reward_model_dir(path: str) -> None:
    """A directory written by ``fuseflow train-rm``: its meta JSON, config.json and weights."""
    from fuseflow.models.hf_io import CONFIG_NAME, WEIGHTS_NAME
    from fuseflow.reward_model.model import META_FILE

    where = f"reward.model={path}"
    d = _directory(path, where, "a directory written by `fuseflow train-rm --output DIR`")
    if not (d / META_FILE).is_file():
        raise ConfigError(f"{where}: not a reward-model directory (no {META_FILE}); train one with "
                          "`fuseflow train-rm --output DIR` and pass reward.model=DIR")
    _json_object(d / META_FILE, where)
    if not (d / CONFIG_NAME).is_file():
        raise ConfigError(f"{where}: no {CONFIG_NAME} there; it is not a complete reward-model directory")
    _json_object(d / CONFIG_NAME, where)
    if not (d / WEIGHTS_NAME).is_file():
        raise ConfigError(f"{where}: no {WEIGHTS_NAME} there; it is not a complete reward-model directory")
    _safetensors_header(d / WEIGHTS_NAME, where)


def _directory(path: str, where: str, expected: str) -> Path:
    d = Path(path).expanduser()
    if not d.exists():
        raise ConfigError(f"{where}: does not exist; pass {expected}")
    if not d.is_dir():
        raise ConfigError(f"{where}: is a file, not a directory; pass {expected}")
    return d


def _json_object(file: Path, where: str) -> dict:
    try:
        data = read_json(file, where)
    except BadFileError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {file.name} should hold a JSON object, got {type(data).__name__}")
    return data


def _safetensors_header(file: Path, where: str) -> None:
    # safe_open parses only the header (offsets and dtypes), not the tensors: a truncated or
    # pickled file fails here in milliseconds instead of at load time inside a worker.
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise ConfigError(f"{where}: {file.name} is listed but missing")
    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"{where}: {file.name} is not a readable safetensors file: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
