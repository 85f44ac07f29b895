"""A tiny tokenizer trained locally: Qwen2-style byte-level BPE, so every digit is its own token.

It is built exactly like Qwen2's tokenizer (NFC, Qwen2's split regex, which isolates each digit
``\\p{N}``, then byte-level BPE) so that it survives ``AutoTokenizer.from_pretrained`` of a Qwen2
checkpoint unchanged: transformers 5 always rebuilds a ``qwen2`` model's tokenizer as
``Qwen2Tokenizer`` from vocab + merges, which would silently re-tokenize any other design.

The chat template has no default system turn and ends every turn with EOS, which is what
generation stops on::

    <bos><|user|>Calculate 37+85<eos><|assistant|>122<eos>

Nothing is added automatically when encoding plain text (no post-processor): the template writes
``<bos>`` itself, so tokenizing the templated text with or without special tokens gives the same ids.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK] + ROLE_TOKENS
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# transformers' Qwen2Tokenizer pre-tokenization regex (digits are split one by one).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on ``corpus`` (256 byte tokens + specials + merges up to
    ``vocab_size``) and wrap it with the special tokens and the chat template. Any text encodes."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, additional_special_tokens=ROLE_TOKENS
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str) -> None:
    """``save_pretrained`` and declare the class ``Qwen2Tokenizer`` (which the files are), so both
    transformers 4 (Qwen2TokenizerFast, loads tokenizer.json as is) and 5 load the same tokenizer."""
    tokenizer.save_pretrained(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "Qwen2Tokenizer"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def prompt_ids(tokenizer: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a user turn followed by the assistant generation prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
