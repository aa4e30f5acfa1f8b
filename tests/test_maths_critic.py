"""The maths-question task's held-out critic measurement (verl_group_ppo.tasks.maths.critic): sampled and scored
replies, and the warm-up step on a tiny converted model (the layout, the values and the explained variance are
tests/test_critic_readout.py's)."""

from __future__ import annotations

import pytest
import torch
from verl_group_ppo_testutils_maths import write_tiny_gguf

from verl_group_ppo.critic_readout import ScoredReplies, WarmupSettings, critic_values, heldout_explained_variance
from verl_group_ppo.tasks.maths import checkpoint
from verl_group_ppo.tasks.maths import evaluation
from verl_group_ppo.tasks.maths.critic import sample_replies, warmup_step
from verl_group_ppo.tasks.maths.task import ARITH_DATA_SOURCES, DATA_SOURCE


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("critic")
    gguf = write_tiny_gguf(str(directory / "tiny.gguf"))
    return checkpoint.convert(str(directory / "model"), gguf_path=gguf, log=lambda m: None, expected=False)


@pytest.fixture(scope="module")
def replies(tiny_model) -> ScoredReplies:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rows = [{"prompt": [{"role": "user", "content": q}], "data_source": DATA_SOURCE,
             "reward_model": {"ground_truth": a}} for q, a in (("12", "3"), ("7", "5"))]
    return sample_replies(policy, tokenizer, rows, samples=3, max_tokens=4, generator=torch.Generator().manual_seed(0))


def _critic(tiny_model):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)
    return AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32)


def _fittable(replies: ScoredReplies) -> ScoredReplies:
    """``replies`` with scores the critic can fit per reply (the first prompt's replies 1, the second's 0)."""
    rewards = torch.zeros_like(replies.rewards)
    rewards[torch.arange(len(replies)), replies.response_mask.sum(1).long() - 1] = torch.tensor([1.0] * 3 + [0.0] * 3)
    return ScoredReplies(replies.input_ids, replies.attention_mask, replies.response_mask, rewards)


def test_sampled_replies_are_scored_and_warmup_steps_fit_them(tiny_model, replies):
    assert isinstance(replies, ScoredReplies) and len(replies) == 6
    assert set(replies.scores.tolist()) <= {0.0, 1.0}
    assert 1 <= replies.response_mask.sum(1).min() and replies.response_mask.sum(1).max() <= 4
    batch = _fittable(replies)
    critic = _critic(tiny_model)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2, weight_decay=0.01)
    losses = [loss for _ in range(15) for loss in warmup_step(critic, optimizer, batch, updates=2)]
    assert len(losses) == 30 and losses[-1] < 0.2 * losses[0]
    assert heldout_explained_variance(critic, batch, batch_size=4).all > 0.5


def test_replies_are_scored_by_the_reward_of_their_rows_data_source(tiny_model, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    reply = "3 over 4 is \\frac{3}{4}"  # the final-number rule reads the LaTeX fraction; the two-way rule reads 4
    ids = tuple(tokenizer(reply)["input_ids"])
    monkeypatch.setattr(evaluation, "sample", lambda model, tok, messages, *args: [
        ((1,), type("Completion", (), {"token_ids": ids})(), reply) for _ in messages])
    rows = [{"prompt": [{"role": "user", "content": "q"}], "data_source": source,
             "reward_model": {"ground_truth": "3/4"}} for source in (sorted(ARITH_DATA_SOURCES)[0], DATA_SOURCE)]
    scored = sample_replies(None, tokenizer, rows, samples=2, max_tokens=8, generator=torch.Generator())
    assert scored.scores.tolist() == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rows: row 1 has no data_source"):
        sample_replies(None, tokenizer, [rows[0], {"prompt": rows[0]["prompt"], "reward_model": {"ground_truth": "1"}}],
                       1, 8, torch.Generator())
    with pytest.raises(ValueError, match="data_source: 'other'"):
        sample_replies(None, tokenizer, [{**rows[0], "data_source": "other"}], 1, 8, torch.Generator())


def test_the_warmup_step_without_the_clip_is_the_recorded_figures_loss(tiny_model, replies):
    """The recorded figures took each update on half the token-mean squared error against the reply's score: the
    default warm-up step (verl's loss, no value clip) takes the same updates, to the bit."""
    batch = _fittable(replies)
    states = []
    for verl_loss in (True, False):
        critic = _critic(tiny_model)
        optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2, weight_decay=0.01)
        for _ in range(3):
            if verl_loss:
                warmup_step(critic, optimizer, batch, updates=2)
                continue
            for rows in (slice(0, 3), slice(3, 6)):
                critic.train()
                part = batch.select(rows)
                mask, returns = part.response_mask, part.scores[:, None] * part.response_mask
                loss = 0.5 * (((critic_values(critic, part) - returns) ** 2) * mask).sum() / mask.sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                optimizer.step()
        states.append(critic.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    clipped = _critic(tiny_model)
    optimizer = torch.optim.AdamW(clipped.parameters(), lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        warmup_step(clipped, optimizer, batch, updates=2, settings=WarmupSettings(cliprange_value=1e-4))
    assert not all(torch.equal(states[0][k], clipped.state_dict()[k]) for k in states[0])  # the clip is applied


def test_a_warmup_step_needs_updates_that_divide_the_batch(tiny_model, replies):
    with pytest.raises(ValueError, match="updates"):
        warmup_step(_critic(tiny_model), torch.optim.SGD(_critic(tiny_model).parameters(), lr=0.0), replies, 4)
