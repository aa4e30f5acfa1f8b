"""Tiny Qwen2-architecture policy and critic built from a transformers config (no downloads), plus the
batched sampling and scoring helpers the demo's RL loop uses.

Sequence layout (verl's, :mod:`verl_group_ppo.critic_readout`): ``[left-padded prompt (P) | response (T,
right-padded)]``. The policy's log-prob of response token t is read at position ``P - 1 + t``, the position
*preceding* response token t, as verl's actor does; the critic's values are read the same way by
:func:`verl_group_ppo.critic_readout.critic_values`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verl_group_ppo import critic_readout

MODEL_SIZES = {
    # name: (hidden, layers, heads, intermediate)
    "tiny": (64, 2, 4, 256),
    "small": (128, 2, 4, 512),
    "base": (192, 3, 6, 768),
}


def qwen2_config(vocab_size: int, size: str = "tiny", max_positions: int = 128, **extra):
    from transformers import Qwen2Config

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    hidden, layers, heads, inter = MODEL_SIZES[size]
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        use_cache=True,
        **extra,
    )


def build_policy(vocab_size: int, size: str = "tiny", seed: int = 0, pad_id: int = 0, eos_id: int = 1):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = qwen2_config(vocab_size, size, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=eos_id)
    return Qwen2ForCausalLM(cfg)


def build_critic(policy, seed: int = 0):
    """A Qwen2 token-classification model (one label = value head), backbone copied from ``policy``.

    This mirrors verl, whose critic is an ``AutoModelForTokenClassification`` initialised from the actor's
    checkpoint. The value head starts at zero output.
    """
    from transformers import Qwen2ForTokenClassification

    torch.manual_seed(seed)
    cfg = qwen2_config(policy.config.vocab_size, max_positions=policy.config.max_position_embeddings,
                       pad_token_id=policy.config.pad_token_id, num_labels=1)
    cfg.hidden_size = policy.config.hidden_size
    cfg.intermediate_size = policy.config.intermediate_size
    cfg.num_hidden_layers = policy.config.num_hidden_layers
    cfg.num_attention_heads = policy.config.num_attention_heads
    cfg.num_key_value_heads = policy.config.num_key_value_heads
    cfg.head_dim = policy.config.hidden_size // policy.config.num_attention_heads
    critic = Qwen2ForTokenClassification(cfg)
    critic.model.load_state_dict(policy.model.state_dict())
    with torch.no_grad():
        critic.score.weight.zero_()
        if critic.score.bias is not None:
            critic.score.bias.zero_()
    return critic.to(next(policy.parameters()).device)


@dataclass
class Rollout:
    """One batch of prompts and sampled responses, laid out as verl lays it out."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) 0/1
    responses: torch.Tensor  # (B, T) right-padded with pad
    response_mask: torch.Tensor  # (B, T) float 0/1, EOS included

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], dim=1)

    def select(self, idx) -> "Rollout":
        return Rollout(self.prompt_ids[idx], self.prompt_mask[idx], self.responses[idx], self.response_mask[idx])


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verl_group_ppo.critic_readout.left_pad` on ``device``: (ids (N, W), mask (N, W)), int64."""
    ids, mask = critic_readout.left_pad(seqs, pad_id)
    return ids.to(device), mask.to(device)


@torch.no_grad()
def sample(policy, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_id: int,
           generator: torch.Generator | None = None, greedy: bool = False, temperature: float = 1.0) -> Rollout:
    """Autoregressive sampling with a KV cache; stops early once every row has emitted EOS."""
    from transformers import DynamicCache

    device = next(policy.parameters()).device
    was_training = policy.training
    policy.eval()
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)
    B = prompt_ids.shape[0]
    attn = prompt_mask.clone()
    pos = critic_readout.position_ids(attn)
    cache = DynamicCache()
    out = policy(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
    logits = out.logits[:, -1].float()
    last_pos = pos[:, -1]
    responses = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    resp_mask = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        if greedy:
            tok = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        responses[:, t] = tok
        resp_mask[:, t] = (~done).float()
        done = done | (tok == eos_id)
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        last_pos = last_pos + 1
        out = policy(input_ids=tok.unsqueeze(1), attention_mask=attn, position_ids=last_pos.unsqueeze(1),
                     past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()
    policy.train(was_training)
    return Rollout(prompt_ids, prompt_mask, responses, resp_mask)


def _response_hidden_slice(rollout: Rollout) -> slice:
    P = rollout.prompt_ids.shape[1]
    T = rollout.responses.shape[1]
    return slice(P - 1, P - 1 + T)


def response_logits(policy, rollout: Rollout) -> torch.Tensor:
    """(B, T, V) logits predicting each response token."""
    attn = rollout.attention_mask
    out = policy(input_ids=rollout.input_ids, attention_mask=attn, position_ids=critic_readout.position_ids(attn),
                 use_cache=False)
    return out.logits[:, _response_hidden_slice(rollout)].float()


def log_probs_and_entropy(policy, rollout: Rollout, with_entropy: bool = False):
    logits = response_logits(policy, rollout)
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, rollout.responses.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy

