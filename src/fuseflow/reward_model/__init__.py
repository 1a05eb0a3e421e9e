"""Reward models for RLHF: Bradley-Terry training on preference pairs, loading and scoring.

``fuseflow train-rm`` writes a directory (``RewardModel.save``) that an RL run loads
with ``reward.model=DIR``; the reward worker then scores finished samples in batches.
"""

from .data import load_pairs, split_pairs
from .model import RewardModel, encode_texts
from .train import pairwise_accuracy, preference_data, train_reward_model

__all__ = ["RewardModel", "encode_texts", "load_pairs", "pairwise_accuracy", "preference_data", "split_pairs",
           "train_reward_model"]
