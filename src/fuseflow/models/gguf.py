"""GGUF files as model sources: converted once into a cached Hugging Face safetensors directory.

transformers reads GGUF (``from_pretrained(dir, gguf_file=name)``, which needs the ``gguf``
package) and dequantizes every tensor to fp32. A model loaded that way refuses
``save_pretrained`` (it still carries the GGUF quantization config), so the dequantized
weights are put into fuseflow's own ``CausalLM`` and saved from there: the directory is a
plain fp32 checkpoint that fuseflow, transformers and any HF-compatible engine load. The
tokenizer (with its chat template) is saved beside it.

The cache key is the file's SHA-256, so an edited or replaced file converts again and a
copy of the same file elsewhere hits the cache. The conversion writes into a temporary
directory that is renamed into place only once complete: an interrupted or failed
conversion leaves nothing that a later run could mistake for a model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from fuseflow.models import hf_io
from fuseflow.models.config import ModelConfig
from fuseflow.models.llama import CausalLM

GGUF_SUFFIX = ".gguf"
GGUF_CACHE = "gguf"  # subdirectory of the config's cache_dir
GGUF_VERSION = 1  # bump when the conversion changes, to invalidate cached directories


def file_digest(path: Path) -> str:
    """SHA-256 of the file's content (hex, first 16 characters)."""
    st = path.stat()
    return _digest(str(path.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    # Keyed by size and mtime too, so one process (which resolves model.path several times) reads
    # the file once, and a file rewritten in place is read again.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def gguf_cache_dir(gguf_file: str | Path, cache_dir: str | Path) -> Path:
    """Where the conversion of ``gguf_file`` lives: ``<cache_dir>/gguf/<stem>-<sha256[:16]>-v<version>``."""
    f = Path(gguf_file).expanduser()
    return Path(cache_dir).expanduser() / GGUF_CACHE / f"{f.stem}-{file_digest(f)}-v{GGUF_VERSION}"


def convert_gguf(gguf_file: str | Path, cache_dir: str | Path, log=None) -> Path:
    """The cached safetensors directory of ``gguf_file``, converting it on first use.

    Returns a directory holding config.json, model.safetensors (fp32) and the tokenizer.
    A file that is not GGUF, is corrupt, or holds an architecture fuseflow's decoder does
    not implement (Llama, Qwen2, Qwen3) raises ``ValueError`` naming the file and the cause.
    """
    src = Path(gguf_file).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"model.path: GGUF file {gguf_file} does not exist")
    target = gguf_cache_dir(src, cache_dir)
    if (target / hf_io.CONFIG_NAME).is_file():
        return target
    if log:
        log(f"Converting {src.name} to a safetensors directory (once; cached in {target})")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert_into(src, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process converted the same file meanwhile: keep its directory
            if not (target / hf_io.CONFIG_NAME).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_into(src: Path, out: Path) -> None:
    try:
        import gguf  # noqa: F401 - transformers needs it; checked here for a message that says how to get it
    except ImportError:
        raise ValueError(f"model.path: reading {src.name} needs the gguf package: pip install gguf "
                         "(or pip install 'fuseflow[real]')") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as exc:  # noqa: BLE001 - any failure to parse is the file's fault: one line, with its cause
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"model.path: cannot read {src} as a GGUF model ({cause})") from None
    hf_cfg = hf.config.to_dict()
    hf_cfg.pop("quantization_config", None)  # the weights are dequantized now
    try:
        config = ModelConfig.from_hf_dict(hf_cfg)
    except ValueError as exc:
        raise ValueError(f"model.path: {src.name}: {exc}") from None
    with torch.device("meta"):
        model = CausalLM(config)
    state = hf.state_dict()
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
    hf_io.load_state_into(model, state, device=torch.device("cpu"), dtype=torch.float32, skip=skip)
    model.tie_weights()
    del hf, state
    model.save_pretrained(out)
    tok.save_pretrained(str(out))
