"""A tiny GGUF file of SmolLM2's layout, written with the ``gguf`` package, for fast conversion tests.

It has what the real file has where the conversion reads it: the ``llama`` architecture, a byte-level BPE tokenizer
(``gpt2`` model, SmolLM2's pre-tokenizer name) holding the three special tokens, a ChatML chat template, EOS and pad
ids as the real file gives them, and float32 tensors under llama.cpp's names. Two layers of width 64 and a vocabulary
of 300: it converts in seconds.
"""

from __future__ import annotations

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 300, 64, 2, 4, 2, 128


def write_tiny_gguf(path: str, seed: int = 0) -> str:
    """Write the tiny model to ``path``; returns ``path``."""
    import gguf
    from tokenizers import pre_tokenizers

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    tokens = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["\u01201", "12"]
    tokens += [f"x{i}" for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (VOCAB - len(SPECIAL_TOKENS)))
    writer.add_token_merges(["\u0120 1", "1 2"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    _add_tensors(writer, np.random.default_rng(seed))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensors(writer, rng: np.random.Generator) -> None:
    def random(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    head = HIDDEN // HEADS
    random("token_embd.weight", VOCAB, HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        random(f"blk.{i}.attn_q.weight", HEADS * head, HIDDEN)
        random(f"blk.{i}.attn_k.weight", KV_HEADS * head, HIDDEN)
        random(f"blk.{i}.attn_v.weight", KV_HEADS * head, HIDDEN)
        random(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head)
        random(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        random(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        random(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
