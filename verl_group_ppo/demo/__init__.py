"""CPU demo: train and compare GROUP-PPO, PPO (GAE) and GRPO. Run ``python -m verl_group_ppo.demo --quick``.

Importing the package loads nothing else: :func:`main` imports the command line (:mod:`.cli`) when called.
"""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m verl_group_ppo.demo`` and the ``verl-group-ppo-demo`` command (see :func:`.cli.main`)."""
    from .cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
