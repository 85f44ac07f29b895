"""Local reward models: Hugging Face ``AutoModelForSequenceClassification`` with one label.

A reward model judges the whole exchange, so it reads ``prompt + separator + response`` tokenised by
ITS OWN tokenizer (not the policy's). The model is on its device only inside each ``score`` call
(``placement.using``): where it waits in between is its :class:`~tidal.rewards.placement.ModelPlacement`'s
decision (the phase owner in training).
It scores every sample of a call (``scores_every_sample``) in ``ceil(B / micro_batch_size)``
forward passes, so ranks with equal batch sizes do identical work even when recipes differ.

A folder exported by Tidal's reward-model job (:mod:`tidal.rm`) holds :data:`FORMAT_FILE`, which
records how its training texts were built (the separator among them); the component then uses the
recorded separator, and a different ``separator`` set in the component is a ConfigError.
"""

from __future__ import annotations

import json
import math
import os

import torch

from tidal.config_base import ConfigError, check
from tidal.rewards.base import ComponentResult, SyncComponent
from tidal.rewards.config import ModelRewardConfig
from tidal.rewards.placement import ModelPlacement
from tidal.rewards.types import RewardSample

FORMAT_FILE = "tidal_reward_format.json"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def load_reward_model(cfg: ModelRewardConfig, *, device: torch.device, key: str):
    """(model, tokenizer, pad_id) from local directories, on CPU; ConfigError at ``key`` if unusable."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok_path = cfg.tokenizer or cfg.path
    check(os.path.isdir(cfg.path), f"{key}.path", f"'{cfg.path}' is not a local model directory")
    check(os.path.isdir(tok_path), f"{key}.tokenizer", f"'{tok_path}' is not a local tokenizer directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_path)
        model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=resolve_dtype(cfg.dtype, device))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}.path", f"cannot load a sequence-classification model: {e}") from e
    check(model.config.num_labels == 1, f"{key}.path", f"reward model must have num_labels=1, has {model.config.num_labels}")
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.pad_token_id
    check(pad_id is not None, f"{key}.tokenizer", "neither the model config nor the tokenizer defines a pad token")
    # HF sequence classifiers pool at the last token that is not pad_token_id: they must agree.
    model.config.pad_token_id = pad_id
    return model, tokenizer, int(pad_id)


def encode_for_reward(tokenizer, texts: list[str], *, max_length: int | None) -> list[list[int]]:
    """Token ids of ``texts`` as a reward model reads them: its own tokenizer with its own special
    tokens; a text longer than ``max_length`` keeps its END (the response), losing the start of the
    prompt; ``None`` keeps every token. Reward-model training (:mod:`tidal.rm`) encodes with this
    same function, so a trained model scores exactly what it was trained on."""
    if max_length is None:
        return [list(ids) for ids in tokenizer(texts)["input_ids"]]
    side = tokenizer.truncation_side
    tokenizer.truncation_side = "left"
    try:
        enc = tokenizer(texts, truncation=True, max_length=max_length)
    finally:
        tokenizer.truncation_side = side
    return [list(ids) for ids in enc["input_ids"]]


def read_reward_format(path: str) -> dict | None:
    """The training-text format recorded in a reward-model folder (:data:`FORMAT_FILE`), or None."""
    file = os.path.join(path, FORMAT_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def resolve_separator(cfg: ModelRewardConfig, *, key: str) -> str:
    """The separator the component uses: the one recorded by training when the folder has a
    record (a different explicit ``separator`` is a ConfigError at ``key.separator``), else the
    configured one (``""`` when unset)."""
    record = read_reward_format(cfg.path)
    if record is None:
        return cfg.separator or ""
    recorded = record["separator"]
    check(cfg.separator is None or cfg.separator == recorded, f"{key}.separator",
          f"{cfg.separator!r} differs from {recorded!r}, with which the model in {cfg.path} was trained "
          f"({FORMAT_FILE}); leave separator unset to use the recorded one")
    return recorded


class ModelReward(SyncComponent):
    """A local reward model as a component; the score is the model's single logit (fp32)."""

    scores_every_sample = True

    def __init__(
        self, cfg: ModelRewardConfig, *, device: torch.device, placement: ModelPlacement, key: str, resident: bool = False
    ):
        """``resident``: keep the model on its device between calls (a dedicated reward server)
        instead of reloading it before and offloading it after each call."""
        self.cfg = cfg
        self.device = device
        self.placement = placement
        self.resident = resident
        model, self.tokenizer, self.pad_id = load_reward_model(cfg, device=device, key=key)
        self.separator = resolve_separator(cfg, key=key)
        self.model = placement.prepare_frozen(model, resident=resident)

    def _encode(self, samples: list[RewardSample]) -> list[list[int]]:
        texts = [s.prompt + self.separator + s.response for s in samples]
        return encode_for_reward(self.tokenizer, texts, max_length=self.cfg.max_length)

    @torch.no_grad()
    def _forward(self, batch: list[list[int]], device: torch.device) -> torch.Tensor:
        T = max(len(ids) for ids in batch)
        ids_BT = torch.full((len(batch), T), self.pad_id, dtype=torch.long)
        mask_BT = torch.zeros((len(batch), T), dtype=torch.long)
        for b, ids in enumerate(batch):
            ids_BT[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask_BT[b, : len(ids)] = 1
        out = self.model(input_ids=ids_BT.to(device), attention_mask=mask_BT.to(device))
        return out.logits[:, 0].float().cpu()

    def score(self, samples: list[RewardSample]) -> ComponentResult:
        if not samples:
            return ComponentResult(scores=[])
        encoded = self._encode(samples)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths pad less
        scores_B = torch.empty(len(encoded))
        mb = self.cfg.micro_batch_size
        with self.placement.using(self.model):
            for start in range(0, len(order), mb):
                idx = order[start : start + mb]
                scores_B[idx] = self._forward([encoded[i] for i in idx], self.device)
        return _checked(scores_B.tolist())


def _checked(scores: list[float]) -> ComponentResult:
    """A non-finite logit is an error of that sample, never a score."""
    result = ComponentResult(scores=scores)
    for i, v in enumerate(scores):
        if not math.isfinite(v):
            result.errors[i] = f"reward model returned {v}"
    return result
