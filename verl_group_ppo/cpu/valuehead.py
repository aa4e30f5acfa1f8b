"""A value-model loader for verl's FSDP critic that uses the configured attention implementation.

verl's ``verl.utils.model.load_valuehead_model`` loads ``AutoModelForTokenClassification`` with a
hard-coded ``attn_implementation="flash_attention_2"`` and, when that fails, falls back to ``trl``'s value
head. Without flash-attn (any CPU machine) the first load fails and the fallback needs ``trl``. The
critic's engine imports the function from the module inside its model-building method, so replacing the
module attribute (:func:`patch_valuehead_loader`) is enough.

The replacement loads the token-classification model with the attention the user configured
(``critic.model.override_config.attn_implementation``, which verl stores on the HF config as
``_attn_implementation``). It does not fall back to ``trl``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .patching import replace_once


def configured_attention(model_config: Any) -> str:
    """The attention implementation recorded on an HF config (``"eager"`` when none is recorded)."""
    return getattr(model_config, "_attn_implementation", None) or "eager"


def check_attention_available(attention: str) -> None:
    """Raise ``ValueError`` with the override to use when a flash-attn implementation is configured
    but the ``flash_attn`` package is not installed (every CPU-only machine)."""
    if attention.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            f"critic.model.override_config.attn_implementation={attention!r} needs the flash_attn package, "
            "which is not installed (no CPU build exists); set "
            "+critic.model.override_config.attn_implementation=sdpa (and the same for actor_rollout_ref.model).")


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

    def make(_original: Any) -> Any:
        def patched(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
            return load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code)

        patched.__doc__ = load_valuehead_model.__doc__
        return patched

    replace_once(verl_model, "load_valuehead_model", make)
