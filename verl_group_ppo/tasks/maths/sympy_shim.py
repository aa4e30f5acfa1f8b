"""The one compatibility shim ``mathematics_dataset`` 1.0.1 needs with today's sympy.

``mathematics_dataset.sample.polynomials`` does ``from sympy.solvers.diophantine import base_solution_linear``.
sympy moved that function into the submodule ``sympy.solvers.diophantine.diophantine`` and no longer exports it
from the package, so importing any of ``mathematics_dataset``'s modules fails. :func:`install` puts the function
back on the package module (nothing else is changed) and checks that it worked; it fails loudly, naming what is
missing and sympy's version, if sympy moves or renames the function again.

Call :func:`import_modules` instead of importing ``mathematics_dataset.modules.modules`` directly: it installs the
shim first.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

PACKAGE = "sympy.solvers.diophantine"
SUBMODULE = "sympy.solvers.diophantine.diophantine"
NAME = "base_solution_linear"


def install() -> None:
    """Make ``from sympy.solvers.diophantine import base_solution_linear`` work (idempotent).

    Raises:
        RuntimeError: when sympy has the function in neither place, naming both and sympy's version.
    """
    import sympy

    importlib.import_module(SUBMODULE)
    # ``import sympy.solvers.diophantine as m`` would give the function ``diophantine`` (sympy.solvers exports a
    # function of the package's name), so take the package module from sys.modules
    package, submodule = sys.modules[PACKAGE], sys.modules[SUBMODULE]
    if callable(getattr(package, NAME, None)):
        return
    function = getattr(submodule, NAME, None)
    if not callable(function):
        raise RuntimeError(
            f"sympy {sympy.__version__} has no {NAME} in {PACKAGE} or {SUBMODULE}: the shim that lets "
            f"mathematics_dataset import (verl_group_ppo.tasks.maths.sympy_shim) needs updating for this sympy")
    setattr(package, NAME, function)


def import_modules() -> ModuleType:
    """``mathematics_dataset.modules.modules`` (the registry of question generators), with the shim installed.

    Raises:
        RuntimeError: naming the failed import when the package still does not import.
    """
    install()
    try:
        return importlib.import_module("mathematics_dataset.modules.modules")
    except ImportError as error:
        raise RuntimeError(f"mathematics_dataset does not import even with the sympy shim installed: {error}. "
                           "Install mathematics_dataset==1.0.1 (scripts/setup.sh does).") from error
