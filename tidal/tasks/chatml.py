"""A tiny tokenizer with Qwen2.5's token layout, trained locally: ChatML control tokens and the
tool-calling tags, for tasks and tests that exercise the real Qwen2.5 / Qwen3 chat templates.

Like Qwen2.5: ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (end of turn: EOS) are
special tokens; ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``,
``<think>``, ``</think>`` are added tokens that are NOT special, so decoding with special tokens
skipped keeps them (a turn's text still shows its tool calls). Pre-tokenization is Qwen2's (every
digit its own token), then byte-level BPE trained on ``corpus``.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tidal.envs.templates import chat_template
from tidal.tasks.tokenizer import QWEN2_SPLIT

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL = [ENDOFTEXT, IM_START, IM_END]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def train_chatml_tokenizer(corpus: Iterable[str], *, template: str = "qwen2_5", vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Train on ``corpus`` and attach the shipped chat template ``template`` (``qwen2_5``/``qwen3``)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                      additional_special_tokens=[IM_START])
    wrapped.chat_template = chat_template(template)
    return wrapped
