"""Post-import hooks: run a function right after a module has executed, without importing it early.

The plugin uses them so that ``import verl`` changes nothing until verl itself imports the module an
install touches (a Ray worker, or a script that only needs ``verl.protocol``, pays nothing for them).
Standard library only.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Any, Callable

Hook = Callable[[ModuleType], None]


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader and runs the hooks once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, hooks: list[Hook]):
        self._loader = loader
        self._hooks = hooks

    def create_module(self, spec):  # noqa: D102 - importlib protocol
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        """Execute the module with its real loader (restored on the module), then run the hooks."""
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportHooks(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that only wraps the loaders of the modules it has hooks for."""

    def __init__(self) -> None:
        self._pending: dict[str, list[Hook]] = {}

    def add(self, module_name: str, hook: Hook) -> None:
        """Run ``hook(module)`` now if the module is already imported, else right after it is.

        Raises RuntimeError when the module is half-imported (its hook could see neither the old nor
        the new state reliably).
        """
        module = sys.modules.get(module_name)
        if module is not None:
            if getattr(module.__spec__, "_initializing", False):
                raise RuntimeError(f"{module_name} is half-imported while the plugin loads; it cannot be hooked")
            hook(module)
            return
        self._pending.setdefault(module_name, []).append(hook)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: D102 - importlib protocol
        if fullname not in self._pending:
            return None
        spec = self._find_with_other_finders(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _HookedLoader(spec.loader, self._pending.pop(fullname))
        if not self._pending and self in sys.meta_path:
            sys.meta_path.remove(self)  # the import system stops iterating once a spec is returned
        return spec

    def _find_with_other_finders(self, fullname: str, path, target):
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


post_import_hooks = PostImportHooks()
"""The hooks of this process (the entry point adds its installs here)."""
