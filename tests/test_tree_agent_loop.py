"""The ``tree_single_turn`` agent loop over verl's own agent-loop base class, with a counting fake server manager
(no Ray, no model): a prompt's samples meet, each asks the server only for its tail, and every row records its
tree position."""

from __future__ import annotations

import asyncio
import random

import pytest
from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from verl_group_ppo.tasks.tiny import chat, variants
from verl_group_ppo.tasks.tiny import prepare as prep
from verl_group_ppo.tasks.tiny.problems import make_task, split_problems
from verl_group_ppo.tree import TreeShape, tree_plan
from verl_group_ppo.tree.agent_loop import TREES, TreeAgentLoop
from verl_group_ppo.tree.assemble import prefix_length

RESPONSE_LENGTH = 12


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    _, train, _ = (None, *split_problems(make_task("chain_sum"), 300, 20))
    hf, vocab, merges = chat.train_tokenizer(variants.single_turn_texts(train, prep.PrepareSettings()), 300)
    path = tmp_path_factory.mktemp("tok")
    chat.save_tokenizer(hf, vocab, merges, str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class FakeServerManager:
    """verl's server manager's ``generate``: random token ids below the vocabulary, counted."""

    def __init__(self, seed: int, vocab: int):
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.requests: list[tuple[list[int], dict]] = []
        self.generated = 0
        self.outputs: list[tuple[list[int], list[int], int]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        await asyncio.sleep(self.rng.random() / 1000)
        limit = min(sampling_params.get("max_tokens", RESPONSE_LENGTH), RESPONSE_LENGTH)
        ids = [self.rng.randrange(5, self.vocab) for _ in range(self.rng.randint(1, limit))]
        self.requests.append((list(prompt_ids), dict(sampling_params)))
        self.generated += len(ids)
        step = self.rng.randint(1, 3)  # the weight version the server held
        self.outputs.append((list(prompt_ids), ids, step))
        return TokenOutput(token_ids=ids, log_probs=[-0.01 * t for t in ids],
                           extra_fields={"min_global_steps": step, "max_global_steps": step})


def _config(shape: dict, n: int):
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"n": n, "prompt_length": 64, "response_length": RESPONSE_LENGTH,
                                          "agent": {"default_agent_loop": "tree_single_turn"}}},
        "data": {}, "tree_rollout": shape})


async def _run(tokenizer, server, shape: dict, n: int, uid: str = "u0"):
    config = _config(shape, n)

    async def one(sample: int):
        loop = TreeAgentLoop(trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer,
                             processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data))
        return await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "1 + 2 ="}], uid=uid,
                              session_id=sample, global_steps=1)

    return await asyncio.gather(*[one(i) for i in range(n)])


def test_the_plugin_registers_the_tree_agent_loop():
    assert _agent_loop_registry["tree_single_turn"] == {"_target_": "verl_group_ppo.tree.agent_loop.TreeAgentLoop"}


@pytest.mark.parametrize("branch_start", ["parent_done", "prefix_ready"])
@pytest.mark.parametrize("shared_prefix", ["once", "per_leaf"])
@pytest.mark.parametrize("seed", range(3))
def test_rows_copy_their_parents_prefix_and_the_server_generates_only_tails(tokenizer, seed, shared_prefix,
                                                                           branch_start):
    shape = {"roots": 2, "branching": [2, 2], "segment_tokens": 3, "shared_prefix": shared_prefix,
             "branch_start": branch_start}
    server = FakeServerManager(seed, len(tokenizer))
    rows = asyncio.run(_run(tokenizer, server, shape, 8))
    assert len(TREES) == 0  # the tree is dropped once its samples finished
    plans = tree_plan(TreeShape.from_config(shape))
    prompt = rows[0].prompt_ids
    # one request per sample; with prefix_ready one more for each piece a parent stopped at for a deeper level
    if branch_start == "parent_done":
        assert len(server.requests) == 8
    else:
        assert 8 <= len(server.requests) <= 8 + 2 * 2 + 2 * 1
    for i, row in enumerate(rows):
        extra = row.extra_fields
        assert row.prompt_ids == prompt
        assert extra["tree_parent"] == (-1 if plans[i].parent is None else plans[i].parent)
        assert 1 <= extra["min_global_steps"] <= extra["max_global_steps"] <= 3
        q = extra["tree_branch_position"]
        assert extra["tree_generated_tokens"] == len(row.response_ids) - q >= 1
        assert len(row.response_ids) == len(row.response_mask) == len(row.response_logprobs) <= RESPONSE_LENGTH
        if extra["tree_parent"] >= 0:
            parent = rows[extra["tree_parent"]]
            assert row.response_ids[:q] == parent.response_ids[:q]
            assert row.response_logprobs[:q] == parent.response_logprobs[:q]
            # once: 0 on the copied prefix and on any first sampled tokens that repeat the parent's
            masked = prefix_length(row.response_ids, parent.response_ids) if shared_prefix == "once" else 0
            assert row.response_mask == [0] * masked + [1] * (len(row.response_ids) - masked)
            assert prompt + row.response_ids[:q] in [ids for ids, _ in server.requests]
        else:
            assert row.response_mask == [1] * len(row.response_ids)
        # every request that generated a token of the row counts, the parent's pieces under the copied prefix too:
        # verl's staleness control reads the span from every row
        for ids, out, step in server.outputs:
            k = len(ids) - len(prompt)
            if out and ids == prompt + row.response_ids[:k] and row.response_ids[k:k + len(out)] == out:
                assert extra["min_global_steps"] <= step <= extra["max_global_steps"]
        assert extra["tree_level"] == plans[i].level
        assert extra["tree_generate_s"] > 0
    assert sum(r.extra_fields["tree_generated_tokens"] for r in rows) == server.generated
    assert all(params.get("max_tokens", RESPONSE_LENGTH) <= RESPONSE_LENGTH for _, params in server.requests)


def test_tree_metrics_read_the_rows_as_verl_stores_them():
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from verl_group_ppo.integration.trainer import tree_metrics

    rows = [{"response_mask": torch.ones(n, dtype=torch.int64), "extra_fields": {"tree_generated_tokens": g}}
            for n, g in ((5, 5), (5, 2), (2, 2), (4, 3))]
    assert tree_metrics(list_of_dict_to_tensordict(rows)) == {"group/tree_generated_tokens": 12.0,
                                                               "group/tree_path_tokens": 16.0}
    for row, (level, seconds) in zip(rows, ((0, 1.0), (1, 0.5), (0, 3.0), (1, 1.5))):
        row["extra_fields"] = {**row["extra_fields"], "tree_level": level, "tree_generate_s": seconds}
    assert tree_metrics(list_of_dict_to_tensordict(rows)) == {
        "group/tree_generated_tokens": 12.0, "group/tree_path_tokens": 16.0,
        "group/tree_round0_generate_s": 2.0, "group/tree_round1_generate_s": 1.0}
    rows[1]["extra_fields"] = {}
    with pytest.raises(RuntimeError, match="1 of 4 rows carry no tree position"):
        tree_metrics(list_of_dict_to_tensordict(rows))


def test_a_piece_ends_the_reply_at_the_tokenizers_and_the_generation_configs_eos(tokenizer, tmp_path):
    from transformers import GenerationConfig

    from verl_group_ppo.tree.agent_loop import stop_token_ids

    GenerationConfig(eos_token_id=[7, 9]).save_pretrained(tmp_path)
    assert tokenizer.eos_token_id is not None
    assert stop_token_ids(tokenizer, str(tmp_path), False) == {tokenizer.eos_token_id, 7, 9}
    assert stop_token_ids(tokenizer, str(tmp_path / "no_model_here"), False) == {tokenizer.eos_token_id}
    from transformers import GPT2Config

    GPT2Config(eos_token_id=11).save_pretrained(tmp_path / "no_generation_config")
    assert stop_token_ids(tokenizer, str(tmp_path / "no_generation_config"), False) == {tokenizer.eos_token_id, 11}
    assert stop_token_ids(tokenizer, None, False) == {tokenizer.eos_token_id}
    assert stop_token_ids(tokenizer, str(tmp_path), True) == frozenset()  # rollout.ignore_eos
