"""CPU demo: train and compare GROUP-PPO, PPO (GAE) and GRPO. Run ``python -m experiments.demo --quick``.

Not installed with the package: run it from the repository root. Importing it loads nothing else: :func:`main` imports the command line (:mod:`.cli`) when called.
"""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.demo`` from the repository root (see :func:`.cli.main`)."""
    from .cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
