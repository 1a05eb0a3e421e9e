"""fuseflow: RL post-training of language models with fine-grained dataflow scheduling."""

__version__ = "0.1.0"
