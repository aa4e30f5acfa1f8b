"""The critic readout (verl_group_ppo.critic_readout): the batch layout, where values are read, the explained
variance on held-out replies, and the warm-up update through verl's value loss."""

from __future__ import annotations

import pytest
import torch

from verl_group_ppo.critic_readout import (
    NO_CLIP,
    HeldOutFit,
    ScoredReplies,
    WarmupSettings,
    critic_values,
    heldout_explained_variance,
    lambda_returns,
    lay_out,
    left_pad,
    monte_carlo_returns,
    position_ids,
    predict_values,
    right_pad,
    warmup_update,
)
from verl_group_ppo.tasks.tiny.model import Rollout, build_critic, build_policy


class _Logits(torch.nn.Module):
    """A stand-in critic whose output at every position is ``fill(input_ids)``."""

    def __init__(self, fill):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.fill = fill

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        out = self.fill(input_ids).float() + 0 * self.anchor
        return type("Output", (), {"logits": out[..., None]})()


def _tiny_critic(seed: int = 0):
    """The tiny task's critic (a Qwen2 token-classification model) with a random value head."""
    critic = build_critic(build_policy(16, "tiny", seed, pad_id=0, eos_id=1), seed)
    with torch.no_grad():
        critic.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return critic


# ----------------------------------------------------------------------------------------------------- layout


def test_left_and_right_padding_put_the_tokens_at_either_end():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]] and mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    ids, mask = right_pad([(5, 6, 7), (8,)], pad_id=9)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 9]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    assert position_ids(torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])).tolist() == [[0, 0, 1, 2, 2],
                                                                                         [0, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="seqs"):
        left_pad([], pad_id=0)


def test_prompts_are_left_padded_and_replies_right_padded():
    got = lay_out([[5, 6], [7]], [[8], [9, 10, 11]], [1.0, 0.5], pad_id=0)
    assert got.input_ids.tolist() == [[5, 6, 8, 0, 0], [0, 7, 9, 10, 11]]
    assert got.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert position_ids(got.attention_mask).tolist() == [[0, 1, 2, 2, 2], [0, 0, 1, 2, 3]]
    assert got.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert got.prompt_width == 2 and len(got) == 2
    assert got.responses.tolist() == [[8, 0, 0], [9, 10, 11]]
    assert got.rewards.tolist() == [[1, 0, 0], [0, 0, 0.5]]  # the score at the reply's last token
    assert got.scores.tolist() == [1.0, 0.5]
    assert got.select(slice(1, 2)).input_ids.tolist() == [[0, 7, 9, 10, 11]]
    assert got.select(torch.tensor([1, 0])).scores.tolist() == [0.5, 1.0]


@pytest.mark.parametrize("args, name", [(([[1]], [[2], [3]], [1.0]), "prompts, replies, scores"),
                                        (([], [], []), "prompts, replies, scores"),
                                        (([[1]], [[]], [1.0]), "replies")])
def test_bad_layouts_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        lay_out(*args, pad_id=0)


def test_scored_replies_of_mismatched_shapes_name_the_tensors():
    ids, mask = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="input_ids, attention_mask"):
        ScoredReplies(ids, mask[:, :4], torch.ones(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="response_mask, rewards"):
        ScoredReplies(ids, mask, torch.ones(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="response_mask, rewards"):
        ScoredReplies(ids, mask, torch.ones(2, 5), torch.zeros(2, 5))  # no room for a prompt


# ----------------------------------------------------------------------------------------------------- values


def test_values_are_read_at_the_position_before_each_reply_token():
    batch = lay_out([[5, 6, 7], [8]], [[1, 2], [3]], [1.0, 0.0], pad_id=0)
    position = _Logits(lambda ids: torch.arange(ids.shape[1]).expand_as(ids))
    assert critic_values(position, batch).tolist() == [[2, 3], [2, 3]]  # prompt width 3: positions 2 and 3


def test_a_real_critics_values_do_not_depend_on_the_padding_and_a_rollout_reads_the_same():
    critic = _tiny_critic().eval()
    prompts, replies = [[5, 6, 7], [8]], [[9, 10], [11]]
    batch = lay_out(prompts, replies, [1.0, 0.0], pad_id=0)
    values = critic_values(critic, batch)
    for row, (prompt, reply) in enumerate(zip(prompts, replies)):
        alone = critic_values(critic, lay_out([prompt], [reply], [0.0], pad_id=0))
        assert torch.allclose(values[row, :len(reply)], alone[0], atol=1e-5)
    width = batch.prompt_width
    rollout = Rollout(batch.input_ids[:, :width], batch.attention_mask[:, :width], batch.responses,
                      batch.response_mask)
    assert torch.equal(critic_values(critic, rollout), values)  # the tiny task's batches read the same way


def test_predict_values_reads_in_eval_mode_by_default_and_restores_the_mode():
    critic = _tiny_critic().train()  # a token-classification head: dropout on its input in train mode
    batch = lay_out([[5, 6], [7], [8, 9]], [[9, 10], [11], [12, 13]], [1.0, 0.0, 1.0], pad_id=0)
    first, chunked = predict_values(critic, batch), predict_values(critic, batch, batch_size=2)
    assert critic.training and not first.requires_grad
    assert torch.allclose(first, chunked, atol=1e-5)
    torch.manual_seed(0)
    noisy = predict_values(critic, batch, eval_mode=False)
    assert not torch.allclose(first, noisy)  # the dropout was active
    with pytest.raises(ValueError, match="batch_size"):
        predict_values(critic, batch, batch_size=0)


# --------------------------------------------------------------------------------------------------- returns


def test_monte_carlo_returns_carry_the_reward_back_over_the_reply():
    batch = lay_out([[5], [6]], [[1, 2, 3], [4]], [1.0, 0.5], pad_id=0)
    assert monte_carlo_returns(batch, 1.0).tolist() == [[1.0, 1.0, 1.0], [0.5, 0.0, 0.0]]
    assert monte_carlo_returns(batch, 0.5).tolist() == [[0.25, 0.5, 1.0], [0.5, 0.0, 0.0]]
    values = torch.tensor([[0.2, 0.4, 0.8], [0.1, 0.0, 0.0]])
    assert torch.allclose(lambda_returns(batch, values, 1.0, 0.0), torch.tensor([[0.4, 0.8, 1.0], [0.5, 0, 0]]))
    with pytest.raises(ValueError, match="gamma, lam"):
        lambda_returns(batch, values, 1.5, 1.0)


# ------------------------------------------------------------------------------------------ explained variance


def test_explained_variance_is_one_for_the_returns_minus_one_inverted_and_zero_for_a_constant():
    batch = lay_out([[5], [6], [7], [8]], [[1, 2], [3], [4, 4], [2]], [1.0, 0.0, 1.0, 0.0], pad_id=0)
    by_prompt = {5: 1.0, 6: 0.0, 7: 1.0, 8: 0.0}  # the prompt token tells the score
    exact = _Logits(lambda ids: torch.tensor([by_prompt[int(row[0])] for row in ids])[:, None].expand_as(ids))
    assert heldout_explained_variance(exact, batch) == HeldOutFit(all=1.0, first=1.0)
    wrong = _Logits(lambda ids: torch.tensor([1.0 - by_prompt[int(row[0])] for row in ids])[:, None].expand_as(ids))
    assert heldout_explained_variance(wrong, batch, batch_size=3) == HeldOutFit(all=-1.0, first=-1.0)  # the clip
    flat = heldout_explained_variance(_Logits(lambda ids: torch.full(ids.shape, 0.3)), batch)
    assert flat.all == pytest.approx(0.0, abs=1e-5) and flat.first == pytest.approx(0.0, abs=1e-5)


def test_first_token_explained_variance_reads_only_the_first_reply_token():
    batch = lay_out([[5], [6], [7], [8]], [[1, 2], [3, 3], [4, 4], [2, 2]], [1.0, 0.0, 1.0, 0.0], pad_id=0)
    # right at the first reply token (position 0, the prompt), a constant 0.5 elsewhere
    first_only = _Logits(lambda ids: torch.cat([(ids[:, :1] % 2 == 1).float(), torch.full((len(ids), 2), 0.5)], 1))
    got = heldout_explained_variance(first_only, batch)
    assert got.first == 1.0 and got.all < 1.0


# ---------------------------------------------------------------------------------------------------- warm-up


def _fit_batch() -> ScoredReplies:
    """Replies whose score the prompt token tells: a critic can fit them."""
    return lay_out([[3, 4], [5], [3], [6, 5]], [[7, 8, 1], [9, 1], [10, 11], [12]], [1.0, 0.0, 1.0, 0.0], pad_id=0)


def test_warmup_updates_decrease_the_loss_on_a_tiny_critic():
    critic = build_critic(build_policy(16, "tiny", 0, pad_id=0, eos_id=1), 0)  # the value head at zero
    batch = _fit_batch()
    returns = monte_carlo_returns(batch, 1.0)
    assert heldout_explained_variance(critic, batch).all == pytest.approx(0.0, abs=1e-4)
    optimizer = torch.optim.Adam(critic.parameters(), lr=3e-3)
    losses = [warmup_update(critic, optimizer, batch, returns, predict_values(critic, batch)) for _ in range(20)]
    assert critic.training
    assert max(losses[-5:]) < 0.1 * losses[0]
    assert heldout_explained_variance(critic, batch).all > 0.9


def test_without_the_clip_verls_value_loss_is_half_the_token_mean_squared_error():
    batch = _fit_batch()
    returns = monte_carlo_returns(batch, 1.0)
    steps = []
    for verl_loss in (True, False):
        torch.manual_seed(0)
        critic = _tiny_critic()
        optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2, weight_decay=0.01)
        for _ in range(3):
            if verl_loss:
                warmup_update(critic, optimizer, batch, returns, predict_values(critic, batch))
            else:
                values, mask = critic_values(critic, batch), batch.response_mask
                loss = 0.5 * (((values - returns) ** 2) * mask).sum() / mask.sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(critic.parameters()), 1.0)
                optimizer.step()
        steps.append(critic.state_dict())
    assert all(torch.equal(steps[0][k], steps[1][k]) for k in steps[0])


def test_the_value_clip_reaches_verls_loss():
    critic = _tiny_critic().eval()
    batch = _fit_batch()
    returns = monte_carlo_returns(batch, 1.0)
    far = predict_values(critic, batch) + 5.0  # pre-update values far above: the clipped branch is the larger loss
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.0)
    free = warmup_update(critic, optimizer, batch, returns, far)
    clipped = warmup_update(critic, optimizer, batch, returns, far, WarmupSettings(cliprange_value=0.1))
    assert clipped > free + 5.0


@pytest.mark.parametrize("settings, name", [(dict(cliprange_value=0.0), "cliprange_value"),
                                            (dict(cliprange_value=float("inf")), "cliprange_value"),
                                            (dict(grad_clip=-1.0), "grad_clip")])
def test_bad_warmup_settings_name_the_field(settings, name):
    with pytest.raises(ValueError, match=name):
        WarmupSettings(**settings)
    assert WarmupSettings().cliprange_value == NO_CLIP


def test_warmup_update_of_mismatched_targets_names_them():
    critic, batch = _tiny_critic(), _fit_batch()
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="returns, old_values"):
        warmup_update(critic, optimizer, batch, torch.zeros(4, 2), torch.zeros(4, 3))
