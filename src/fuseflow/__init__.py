"""fuseflow: RL post-training of language models with fine-grained dataflow scheduling."""

import os

# Exact resume needs the same update to give the same bits in a new process. Intel MKL's matrix
# products may round differently with the memory alignment of their operands (an async PPO resume
# diverged in the last bits of a critic update whose inputs, weights and optimizer state were
# bitwise equal; docs/recovery.md). Strict conditional numerical reproducibility makes them
# alignment-independent. MKL reads this at its first call, so setting it on import is in time;
# a value the user set wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
