"""CPU demo: train and compare GROUP-PPO, PPO (GAE) and GRPO. Run ``python -m verl_group_ppo.demo --quick``."""

from .cli import build_parser, main

__all__ = ["build_parser", "main"]
