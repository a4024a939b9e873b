"""Tiny random Llama models and a byte-level BPE tokenizer built in milliseconds, saved as model folders."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from workers.engine.drafter import Drafter, pack

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "rewrite this sentence politely please",
          "def add(a, b): return a + b", "extract the names and dates from the text below",
          "why is the sky blue? because of rayleigh scattering", "0123456789 {}[]()<>:;,.!?'\"\n\t"]


def tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(vocab_size: int, layers: int = 2, seed: int = 0, hidden: int = 64, dtype=torch.float64,
               max_positions: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, initializer_range=0.2, tie_word_embeddings=False,
                         eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_draft(target: LlamaForCausalLM, layers: int = 1) -> LlamaForCausalLM:
    """A draft sharing the target's embeddings, head and first layers: it agrees with the target often, not always."""
    config = target.config.__class__(**{**target.config.to_dict(), "num_hidden_layers": layers})
    draft = LlamaForCausalLM(config).to(target.dtype).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft


def save_model_dir(path: Path, model, tokenizer) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


class StubTokenizer:
    """Just enough of a tokenizer for the generator when tests feed token ids directly: ids decode to
    space-separated numbers, and there is no EOS unless one is given."""

    def __init__(self, eos_token_id: int | None = None):
        self.eos_token_id = eos_token_id

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


class OracleDrafter(Drafter):
    """A plugged-in drafter that knows the target's greedy continuation of every prompt (`references`,
    keyed by the prompt's token tuple) and proposes each next token correctly with probability `alpha`,
    independently per position, and a wrong token otherwise. Its acceptance is therefore known exactly."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], alpha: float, vocab_size: int, seed: int = 0):
        import numpy as np

        self.references, self.alpha, self.vocab_size = references, alpha, vocab_size
        self.rng = np.random.default_rng(seed)
        self.proposed = 0

    def propose(self, rows, k: int, caps: list[int]):
        drafts = []
        for row, cap in zip(rows, caps):
            reference = self.references[tuple(row.tokens[: row.prompt_len])]
            done = row.tokens[row.prompt_len :]
            assert done == reference[: len(done)], "the generator left the target's greedy path"
            draft = []
            for position in range(len(done), len(done) + max(0, min(k, cap))):
                right = reference[position] if position < len(reference) else 0
                wrong = (right + 1 + int(self.rng.integers(self.vocab_size - 1))) % self.vocab_size
                draft.append(right if self.rng.random() < self.alpha else wrong)
            drafts.append(draft)
            self.proposed += len(draft)
        return pack(drafts, k)
