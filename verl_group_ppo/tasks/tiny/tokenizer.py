"""A character-level tokenizer trained locally with ``tokenizers`` on the task's own text (no downloads)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
SPECIAL = [PAD, EOS, BOS]


class CharTokenizer:
    """Thin wrapper around a ``tokenizers.Tokenizer`` with one token per character."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.pad_id = tok.token_to_id(PAD)
        self.eos_id = tok.token_to_id(EOS)
        self.bos_id = tok.token_to_id(BOS)
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: list[str]) -> "CharTokenizer":
        tok = Tokenizer(models.WordLevel(unk_token=None))
        # every character is its own pre-token, spaces included
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL, min_frequency=1, show_progress=False)
        tok.train_from_iterator(sorted(set("".join(texts))), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_str(cls, s: str) -> "CharTokenizer":
        return cls(Tokenizer.from_str(s))

    def to_str(self) -> str:
        return self.tok.to_str()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i in (self.pad_id, self.bos_id, self.eos_id):
                continue
            out.append(self.tok.id_to_token(i))
        return "".join(out)

    def token_str(self, i: int) -> str:
        return self.tok.id_to_token(int(i))
