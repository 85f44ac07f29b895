"""A scripted "model" behind the engine's ``generate`` contract, for rollouts without a network."""

from __future__ import annotations

import dataclasses
from typing import Callable

from tidal.engine.base import Completion, SamplingParams
from tidal.envs import ChatRenderer, EnvRow


def char_ids(tok, text: str) -> list[int]:
    """``text`` as one byte-level token per character (ASCII): a valid but NON-canonical
    tokenization, so any re-encoding of it would show (BPE merges differ)."""
    mapping = {ord(" "): "Ġ", ord("\n"): "Ċ"}  # byte-level names of space and newline
    ids = []
    for ch in text:
        token = mapping.get(ord(ch), ch)
        tid = tok.convert_tokens_to_ids(token)
        assert tid is not None and tid != tok.unk_token_id, (ch, token)
        ids.append(tid)
    return ids


@dataclasses.dataclass
class Call:
    prompts: list[list[int]]
    params: SamplingParams


class ScriptedEngine:
    """``policy(context_text, turn_index) -> reply text``; the reply is sampled as char ids followed
    by ``<|im_end|>`` (cut at ``max_new_tokens``, then finish ``length``). Logprob of the k-th token
    sampled by this engine: ``-k / 1000`` (distinct, to check alignment)."""

    def __init__(self, tok, policy: Callable[[str, int], str], on_generate: Callable[[list[str]], None] | None = None):
        self.tok, self.policy, self.on_generate = tok, policy, on_generate
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[Call] = []
        self.sampled = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.calls.append(Call([list(p) for p in prompts], params))
        texts = [self.tok.decode(p) for p in prompts]
        if self.on_generate:
            self.on_generate(texts)
        out = []
        for p, text in zip(prompts, texts):
            turn = text.count("<|im_start|>assistant") - 1
            for _ in range(params.n):
                ids = char_ids(self.tok, self.policy(text, turn)) + [self.eos]
                reason = "stop"
                if len(ids) > params.max_new_tokens:
                    ids, reason = ids[: params.max_new_tokens], "length"
                logps = [-(self.sampled + k + 1) / 1000 for k in range(len(ids))]
                self.sampled += len(ids)
                out.append(Completion(prompt_ids=list(p), token_ids=ids, logprobs=logps, finish_reason=reason))
        return out


def chat_row(tok, question: str, reference=None, where="test.jsonl:1") -> EnvRow:
    messages = [{"role": "user", "content": question}]
    ids = ChatRenderer(tok).prompt_ids(messages)
    return EnvRow(prompt_ids=ids, prompt_text=tok.decode(ids), messages=messages, reference=reference, where=where)
