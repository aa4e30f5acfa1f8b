"""The entry point's former location, kept for installs whose metadata names ``verl_group_ppo.plugin``.

Importing it imports :mod:`verl_group_ppo.integration.entry_point`, which installs everything once.
"""

from verl_group_ppo.integration.entry_point import INSTALLS, install, install_errors  # noqa: F401

__all__ = ["INSTALLS", "install", "install_errors"]
