"""A value-model loader for verl's FSDP critic that uses the configured attention implementation.

verl's ``verl.utils.model.load_valuehead_model`` loads ``AutoModelForTokenClassification`` with a
hard-coded ``attn_implementation="flash_attention_2"`` and, when that fails, falls back to ``trl``'s value
head, again with flash-attn. Without flash-attn (any CPU machine, and any GPU node without the package) the
critic does not load. The critic's engine imports the function from the module inside its model-building
method, so replacing the module attribute (:func:`patch_valuehead_loader`) is enough. The plugin installs
the replacement on every platform when verl imports ``verl.utils.model``, after checking that the function
it replaces is still there with the parameters it expects (:func:`~verl_group_ppo.cpu.patching.check_target`).

The replacement loads the token-classification model with the attention the user configured
(``critic.model.override_config.attn_implementation``, which verl stores on the HF config as
``_attn_implementation``). It does not fall back to ``trl``. verl's default for that key is
``flash_attention_2``; :func:`check_critic_attention` says before Ray starts when that default (or an
explicit flash-attn setting) cannot load here, and names the override to use.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .patching import check_target, replace_once

VERL_DEFAULT_ATTENTION = "flash_attention_2"
"""The attention verl asks for when ``model.override_config.attn_implementation`` is not set."""

LOADER_PARAMETERS = ("local_path", "torch_dtype", "model_config", "trust_remote_code")
"""The parameters of ``verl.utils.model.load_valuehead_model`` that the replacement takes."""


def configured_attention(model_config: Any) -> str:
    """The attention implementation recorded on an HF config (``"eager"`` when none is recorded)."""
    return getattr(model_config, "_attn_implementation", None) or "eager"


def flash_attn_installed() -> bool:
    """Whether the ``flash_attn`` package can be imported here."""
    return importlib.util.find_spec("flash_attn") is not None


def check_attention_available(attention: str) -> None:
    """Raise ``ValueError`` with the override to use when a flash-attn implementation is configured
    but the ``flash_attn`` package is not installed (every CPU-only machine)."""
    if attention.startswith("flash_attention") and not flash_attn_installed():
        raise ValueError(
            f"critic.model.override_config.attn_implementation={attention!r} needs the flash_attn package, "
            "which is not installed here (it has no CPU build); set "
            "+critic.model.override_config.attn_implementation=sdpa (and the same for actor_rollout_ref.model).")


def critic_attention(config: Any) -> str:
    """``critic.model.override_config.attn_implementation`` of a trainer config (mapping or DictConfig),
    verl's default (:data:`VERL_DEFAULT_ATTENTION`) when unset."""
    node: Any = config
    for key in ("critic", "model", "override_config"):
        node = node.get(key) if node is not None and hasattr(node, "get") else None
    value = node.get("attn_implementation") if node is not None and hasattr(node, "get") else None
    return str(value) if value else VERL_DEFAULT_ATTENTION


def check_critic_attention(config: Any) -> None:
    """Raise ``ValueError`` naming ``+critic.model.override_config.attn_implementation=sdpa`` when the critic
    would ask for flash-attn (explicitly or by verl's default) and the ``flash_attn`` package is missing."""
    check_attention_available(critic_attention(config))


def load_valuehead_model(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
    """Load the critic: ``AutoModelForTokenClassification`` (one label) with the configured attention.

    Same signature as ``verl.utils.model.load_valuehead_model``. Raises ``ValueError`` when the configured
    attention cannot run here, and lets transformers' error through when the model type has no
    token-classification class (the ``trl`` fallback of verl's loader is not offered).
    """
    from transformers import AutoModelForTokenClassification

    attention = configured_attention(model_config)
    check_attention_available(attention)
    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation=attention,
        trust_remote_code=trust_remote_code,
    )


def patch_valuehead_loader() -> None:
    """Replace ``verl.utils.model.load_valuehead_model`` with :func:`load_valuehead_model` (idempotent)."""
    import verl.utils.model as verl_model

    check_target(verl_model, "load_valuehead_model", LOADER_PARAMETERS)

    def make(_original: Any) -> Any:
        def patched(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
            return load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code)

        patched.__doc__ = load_valuehead_model.__doc__
        return patched

    replace_once(verl_model, "load_valuehead_model", make)
