"""One sequence being generated: its tokens, its KV blocks, and where it is in its life.

A sequence knows nothing about the model or the device; the scheduler moves it between
``WAITING`` (needs prefill: new, chunk-prefilled part-way, or preempted) and ``RUNNING`` (decoding),
and the block manager fills its ``block_table``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.engine.native.multimodal import MultimodalPrompt


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Token ids and KV bookkeeping of one completion.

    Invariants:
    - ``token_ids`` = prompt + generated tokens; ``logprobs[i]`` is the sampling logprob of
      generated token i.
    - KV of tokens ``[0, num_cached_tokens)`` is in the cache (blocks ``block_table``); a step
      computes ``num_scheduled_tokens`` more, starting at ``num_cached_tokens``.
    - ``block_hashes[i]`` is the prefix hash of full block i once its KV is (being) computed; the
      chain starts from ``cache_key`` (None for text, a hash of the images for an image prompt).
    - ``mm`` (image prompts only) is shared by the ``n`` sequences of one prompt and read-only here.
    """

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "max_tokens", "logprobs", "status",
        "finish_reason", "num_cached_tokens", "num_scheduled_tokens", "block_table", "block_hashes", "mm",
    )

    def __init__(self, seq_id: int, prompt_ids: list[int], max_tokens: int, mm: "MultimodalPrompt | None" = None):
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        self.seq_id = seq_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.max_tokens = max_tokens
        self.logprobs: list[float] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.mm = mm

    @property
    def cache_key(self) -> int | None:
        return None if self.mm is None else self.mm.key

    @property
    def rope_delta(self) -> int:
        """Offset of generated tokens' RoPE positions from their index (M-RoPE prompts; else 0)."""
        return 0 if self.mm is None else self.mm.rope_delta

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    def block(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def append(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
