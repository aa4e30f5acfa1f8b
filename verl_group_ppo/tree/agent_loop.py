"""The ``tree_single_turn`` agent loop (verl glue): verl's single-turn chat completion, with a prompt's ``rollout.n``
samples sampled as one tree (:mod:`verl_group_ppo.tree`).

Chosen by ``actor_rollout_ref.rollout.agent.default_agent_loop=tree_single_turn`` (or a row's ``agent_name``), the
shape by the ``tree_rollout`` block (:class:`~verl_group_ppo.tree.shape.TreeShape`). The plugin registers it in
every process that imports verl's agent-loop module (the ``verl.plugins`` entry point's post-import hook).

Each sample (verl's ``session_id``) instantiates this class and calls :meth:`TreeAgentLoop.run`; the samples of
one prompt meet in this worker's :data:`TREES`, keyed by ``(uid, global_steps)``
(:func:`~verl_group_ppo.tree.coordinator.sample_in_tree`). A sample asks the server only for its own tail (in
pieces where its children branch; :func:`stop_token_ids` tells a piece that ended the reply); its row
is an ordinary verl row (prompt + full reply, scored by the run's reward function), with its tree position in
``extra_fields``: ``tree_parent`` (-1 for a root), ``tree_branch_position``, ``tree_generated_tokens``,
``tree_level`` (0 for a root) and ``tree_generate_s`` (its time in the server's ``generate``), beside
the server's own fields (``min_global_steps`` / ``max_global_steps`` widened to the parent's: :func:`weight_span`).

Text prompts only: a row with images, videos or audio is refused.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Optional
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from verl_group_ppo.tree.assemble import Reply
from verl_group_ppo.tree.coordinator import TreeRegistry, sample_in_tree
from verl_group_ppo.tree.limits import TREE_AGENT
from verl_group_ppo.tree.shape import TREE_PATH, TreeShape, tree_plan

__all__ = ["AGENT_NAME", "TREES", "TreeAgentLoop", "stop_token_ids", "weight_span"]

AGENT_NAME = TREE_AGENT

TREES = TreeRegistry()
"""The trees in flight in this agent-loop worker process."""


@register(AGENT_NAME)
class TreeAgentLoop(AgentLoopBase):
    """One sample of a prompt's tree (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shape = TreeShape.from_config(self.config.get(TREE_PATH))
        self.response_length = int(self.rollout_config.response_length)
        self.stop_ids: frozenset[int] = frozenset()  # read only by replies asked for in pieces (prefix_ready)
        if self.shape.branch_start == "prefix_ready":
            model = self.config.get("actor_rollout_ref", {}).get("model", {}) or {}
            self.stop_ids = stop_token_ids(self.tokenizer, model.get("path"),
                                           bool(self.rollout_config.get("ignore_eos")))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """The sample ``kwargs['session_id']`` of prompt ``kwargs['uid']``: a root or a branch, as the tree's plan
        says; returns its row."""
        messages = list(kwargs["raw_prompt"])
        if await self.process_multi_modal_info(messages):
            raise ValueError(f"the {AGENT_NAME} agent loop takes text prompts only; this row has multi-modal inputs "
                             "(use actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent)")
        sample = int(kwargs["session_id"])  # verl numbers a prompt's samples 0..n-1
        key = (str(kwargs["uid"]), kwargs.get("global_steps"))
        plan = tree_plan(self.shape, sample + 1)[sample]
        prompt_ids = await self.ct_build_initial_tokens(messages)
        tree = TREES.tree(key)
        server_fields: dict[str, Any] = {}
        metrics: dict[str, Any] = {"generate_sequences": 0.0}
        row_prompt = list(prompt_ids)
        priority = int(kwargs.get("priority", 0))

        async def generate(token_ids: list[int], max_tokens: Optional[int]) -> Reply:
            params = dict(sampling_params)
            if max_tokens is not None:
                params["max_tokens"] = max_tokens
            start = time.perf_counter()
            output = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=token_ids,
                                                        sampling_params=params, priority=priority)
            metrics["generate_sequences"] += time.perf_counter() - start
            fields = weight_span(_span_so_far(tree, sample, plan.parent), dict(output.extra_fields))
            tree.notes[sample] = fields
            server_fields.update(fields)
            metrics.setdefault("num_preempted", output.num_preempted if output.num_preempted is not None else -1)
            ids = list(output.token_ids)
            return Reply(ids=ids, mask=[1] * len(ids), log_probs=list(output.log_probs) if output.log_probs else None)

        async def assemble(assistant: Reply) -> Reply:
            merged, mask, log_probs = await self.ct_merge_assistant_token(
                prompt_ids, assistant.ids, [], [] if assistant.log_probs else None,
                assistant_logprobs=assistant.log_probs)
            ids = merged.token_ids[-len(mask):] if mask else []
            row_prompt[:] = merged.token_ids[:len(merged.token_ids) - len(mask)]
            return Reply(ids=list(ids), mask=list(mask), log_probs=list(log_probs) if log_probs else None)

        try:
            stops = self.stop_ids | set(sampling_params.get("stop_token_ids") or ())
            sample = await sample_in_tree(tree, plan, self.shape, prompt_ids, generate, self.response_length,
                                          assemble, stops)
        finally:
            TREES.finished(key, self.shape.size)
        reply = sample.reply
        length = self.response_length
        output = AgentLoopOutput(
            prompt_ids=row_prompt,
            response_ids=reply.ids[:length],
            response_mask=reply.mask[:length],
            response_logprobs=reply.log_probs[:length] if reply.log_probs else None,
            num_turns=2,
            metrics=metrics,
            extra_fields={**server_fields, "turn_scores": [], "tool_rewards": [], **sample.extra_fields(),
                          "tree_level": plan.level, "tree_generate_s": metrics["generate_sequences"]},
        )
        return output


def stop_token_ids(tokenizer: Any, model_path: Optional[str], ignore_eos: bool) -> frozenset[int]:
    """The token ids at which the server ends a reply: the tokenizer's ``eos_token_id`` and the model's generation
    config's, or its config's when it has no generation config (vLLM stops at both, the ``hf`` rollout at the
    latter); none with ``rollout.ignore_eos``. A tree sample
    asked for a piece of ``k`` tokens that got ``k`` back reads its reply as ended when the last one is among
    these."""
    if ignore_eos:
        return frozenset()
    ids = set(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    if model_path and os.path.isdir(str(model_path)):
        ids |= _generation_config_eos(str(model_path))
    return frozenset(ids)


@functools.lru_cache(maxsize=8)
def _generation_config_eos(model_path: str) -> frozenset[int]:
    from transformers import AutoConfig, GenerationConfig

    try:
        return frozenset(_as_ids(GenerationConfig.from_pretrained(model_path).eos_token_id))
    except OSError:  # no generation_config.json: the model config's EOS, as the servers fall back to it
        pass
    try:
        return frozenset(_as_ids(getattr(AutoConfig.from_pretrained(model_path), "eos_token_id", None)))
    except (OSError, ValueError):  # not a model folder: the tokenizer's EOS alone
        return frozenset()


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _span_so_far(tree: Any, sample: int, parent: Optional[int]) -> dict[str, Any]:
    """The server fields a sample's next piece widens: its own previous pieces' (which hold its parent's prefix),
    or, before its first piece, its parent's so far."""
    own = tree.notes.get(sample)
    if own is None and parent is not None:
        own = tree.notes.get(parent)
    return own or {}


def weight_span(parent: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The server's ``extra_fields`` for a branch: its own, with ``min_global_steps`` / ``max_global_steps`` widened
    to the parent's (the copied prefix was generated by the weights the parent saw; verl's staleness control reads
    the two from every row)."""
    fields = dict(own)
    for key, pick in (("min_global_steps", min), ("max_global_steps", max)):
        known = [v for v in (parent.get(key), own.get(key)) if v is not None]
        if known:
            fields[key] = pick(known)
    return fields
