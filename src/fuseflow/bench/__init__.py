"""End-to-end benchmarks that drive whole RL runs (``fuseflow bench trl``; later ``bench fusion``).

Subsystem benchmarks live next to their subsystem (``rollout/bench.py``,
``schedule/pipeline/bench.py``); the ones here run the trainer itself, and sometimes
another framework beside it, so they sit above the programs layer.
"""
