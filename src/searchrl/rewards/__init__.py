"""Reward functions: a registry of outcome and process rewards, and the ones the papers define."""

from searchrl.rewards.contract import REWARDS, RewardOutput, register_reward

__all__ = ["REWARDS", "RewardOutput", "register_reward"]
