"""Continuous-batching rollout engine: paged KV cache, shared prefixes, streaming, abort/resume.

Policy (`scheduler.py`) is split from mechanism (`runner.py`, `kv.py`), as in nano-vllm;
`engine.py` ties them together in a `step()` that fits on one screen.
"""

from .engine import Engine, EngineConfig
from .sequence import PartialState

__all__ = ["Engine", "EngineConfig", "PartialState"]
