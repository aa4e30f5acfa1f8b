"""The real-model task's held-out critic measurement (verl_group_ppo.smollm2.critic): layout, where values are
read, the explained variance it reports, and updates on a tiny converted model."""

from __future__ import annotations

import pytest
import torch
from verl_group_ppo_testutils_smollm2 import write_tiny_gguf

from verl_group_ppo.smollm2 import checkpoint
from verl_group_ppo.smollm2.critic import ScoredReplies, critic_values, heldout_explained_variance, lay_out, \
    sample_replies, update


class _Logits(torch.nn.Module):
    """A stand-in critic whose output at every position is ``fill(input_ids)``."""

    def __init__(self, fill):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.fill = fill

    def forward(self, input_ids, attention_mask, position_ids):
        out = self.fill(input_ids).float() + 0 * self.anchor
        return type("Output", (), {"logits": out[..., None]})()


def test_prompts_are_left_padded_and_replies_right_padded():
    got = lay_out([[5, 6], [7]], [[8], [9, 10, 11]], [1.0, 0.0], pad_id=0)
    assert got.input_ids.tolist() == [[5, 6, 8, 0, 0], [0, 7, 9, 10, 11]]
    assert got.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert got.position_ids.tolist() == [[0, 1, 2, 2, 2], [0, 0, 1, 2, 3]]
    assert got.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert got.prompt_width == 2
    assert got.returns().tolist() == [[1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("args, name", [(([[1]], [[2], [3]], [1.0]), "prompts, replies, scores"),
                                        (([[1]], [[]], [1.0]), "replies")])
def test_bad_layouts_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        lay_out(*args, pad_id=0)


def test_values_are_read_at_the_position_before_each_reply_token():
    batch = lay_out([[5, 6, 7], [8]], [[1, 2], [3]], [1.0, 0.0], pad_id=0)
    position = _Logits(lambda ids: torch.arange(ids.shape[1]).expand_as(ids))
    assert critic_values(position, batch).tolist() == [[2, 3], [2, 3]]  # prompt width 3: positions 2 and 3


def test_explained_variance_is_one_for_the_returns_and_zero_for_a_constant():
    batch = lay_out([[5], [6], [7], [8]], [[1, 2], [3], [4, 4], [2]], [1.0, 0.0, 1.0, 0.0], pad_id=0)
    by_prompt = {5: 1.0, 6: 0.0, 7: 1.0, 8: 0.0}  # the prompt token tells the score
    exact = _Logits(lambda ids: torch.tensor([by_prompt[int(row[0])] for row in ids])[:, None].expand_as(ids))
    assert heldout_explained_variance(exact, batch) == {"all": 1.0, "first": 1.0}
    wrong = _Logits(lambda ids: torch.tensor([1.0 - by_prompt[int(row[0])] for row in ids])[:, None].expand_as(ids))
    assert heldout_explained_variance(wrong, batch) == {"all": -1.0, "first": -1.0}  # clipped at -1
    flat = _Logits(lambda ids: torch.full(ids.shape, 0.3))
    assert heldout_explained_variance(flat, batch) == pytest.approx({"all": 0.0, "first": 0.0}, abs=1e-5)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("critic")
    gguf = write_tiny_gguf(str(directory / "tiny.gguf"))
    return checkpoint.convert(str(directory / "model"), gguf_path=gguf, log=lambda m: None, expected=False)


def test_sampled_replies_are_scored_and_critic_updates_fit_them(tiny_model):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rows = [{"prompt": [{"role": "user", "content": q}], "reward_model": {"ground_truth": a}}
            for q, a in (("12", "3"), ("7", "5"))]
    replies = sample_replies(policy, tokenizer, rows, samples=3, max_tokens=4,
                             generator=torch.Generator().manual_seed(0))
    assert isinstance(replies, ScoredReplies) and len(replies) == 6
    assert set(replies.scores.tolist()) <= {0.0, 1.0}
    assert 1 <= replies.response_mask.sum(1).min() and replies.response_mask.sum(1).max() <= 4
    batch = ScoredReplies(replies.input_ids, replies.attention_mask, replies.position_ids, replies.response_mask,
                          torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]))  # scores the critic can fit per reply
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2, weight_decay=0.01)
    losses = [update(critic, optimizer, batch) for _ in range(30)]
    assert losses[-1] < 0.2 * losses[0]
    assert heldout_explained_variance(critic, batch)["all"] > 0.5
