"""The tiny task's chat format and its tokenizer: ChatML templates, a byte-level BPE trained on the task's text,
and the tokenizer interface the warm start and the checks use.

* :data:`CHAT_TEMPLATE` (the single-turn task) and :data:`TOOL_CHAT_TEMPLATE` (the tool task, with a ``tool`` role
  and the calls written back in the ``tinycalc`` format);
* :func:`train_tokenizer` trains the BPE and builds transformers' ``Qwen2Tokenizer`` from it,
  :func:`save_tokenizer` writes it beside the model;
* :class:`ChatTokenizer` wraps it for the warm start: a prompt is encoded through the chat template exactly as verl's
  dataset encodes it, a response ends with EOS (``<|im_end|>``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from .tooluse import call_jinja

PAD_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
#: ChatML, the format of Qwen's instruct models: ``<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n``
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: the tool task's ChatML. A tool reply is a ``tool`` message; an assistant message's calls (verl keeps them apart
#: from its text) are written back in the ``tinycalc`` format (:func:`.tooluse.call_jinja`, from the format's one
#: definition); the tool schemas are not rendered (the warm start teaches the one tool), which keeps prompts short.
TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}{% set args = call['function']['arguments'] %}"
    + call_jinja() + "{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_messages(prompt: str) -> list[dict[str, str]]:
    """The row's ``prompt`` column: one user message holding the task's prompt."""
    return [{"role": "user", "content": prompt}]


class ChatTokenizer:
    """The HF tokenizer behind the interface the warm start and the evaluation use (see
    :class:`~.tokenizer.CharTokenizer`): prompts are encoded through the chat template, a response ends with EOS
    (``<|im_end|>``)."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self.pad_id = hf_tokenizer.pad_token_id
        self.eos_id = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)
        self._prompt_ids: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: str) -> list[int]:
        """Ids of the chat-templated prompt, exactly as verl's dataset builds them (cached: the warm start
        encodes the same training prompts many times, and rendering the template costs ~0.15 ms)."""
        if prompt not in self._prompt_ids:
            self._prompt_ids[prompt] = list(self.hf.apply_chat_template(
                chat_messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False))
        return list(self._prompt_ids[prompt])

    def decode(self, ids: Sequence[int], stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.hf.decode(ids, skip_special_tokens=True)

    def to_str(self) -> str:
        return self.hf.backend_tokenizer.to_str()


def train_tokenizer(texts: Sequence[str], vocab_size: int, chat_template: str = CHAT_TEMPLATE,
                    added_tokens: Sequence[str] = ()):
    """A byte-level BPE trained on ``texts`` with Qwen2's normaliser and pre-tokeniser (so the tokenizer
    transformers rebuilds from ``vocab.json`` + ``merges.txt`` is this one), with ``added_tokens`` (plain tokens
    beyond ChatML's special ones) and ``chat_template``. Returns (Qwen2Tokenizer, vocab, merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    hf = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=PAD_TOKEN,
                        extra_special_tokens=[IM_START])
    if added_tokens:
        hf.add_tokens(list(added_tokens))
    hf.chat_template = chat_template
    return hf, vocab, merges


def save_tokenizer(hf_tokenizer: Any, vocab: dict[str, int], merges: Sequence[tuple[str, str]], path: str) -> None:
    """``save_pretrained`` plus ``vocab.json`` and ``merges.txt`` (the files a Qwen2Tokenizer is built from)."""
    hf_tokenizer.save_pretrained(path)
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
