"""The trained reward model: an HF ``AutoModelForSequenceClassification`` with one label, and how
a batch of pairs goes through it.

The forward is the one the ``type: model`` reward component runs when it scores
(:class:`tidal.rewards.model.ModelReward`): right-padded ``input_ids`` with their attention mask,
no position ids, and the score is ``logits[:, 0]``, which HF takes at each row's last token that is
not ``config.pad_token_id``.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from tidal.config_base import ConfigError, check
from tidal.models.vision import is_vision_language
from tidal.rm.dataset import Pair


def load_trainable_reward_model(path: str, *, tokenizer_pad_id: int | None, seed: int, key: str = "model.path") -> torch.nn.Module:
    """``path`` (a causal LM, or a classifier with one label) as a one-label sequence classifier in
    fp32 on CPU. A causal LM gets a fresh scalar head (HF's initialisation, drawn after
    ``torch.manual_seed(seed)``, so every rank draws the same one). ``config.pad_token_id`` is the
    model's own, else ``tokenizer_pad_id``: the pooling and the padding use it."""
    config = AutoConfig.from_pretrained(path)
    check(not is_vision_language(config), key, "is a vision-language model; reward-model training supports text models only")
    archs = config.architectures or []
    if any("SequenceClassification" in a for a in archs):
        check(config.num_labels == 1, key, f"is a classifier with num_labels={config.num_labels}; a reward model has one label")
    torch.manual_seed(seed)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    except (ValueError, OSError) as e:
        raise ConfigError(key, f"cannot load {path!r} as a sequence classifier: {e}") from None
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer_pad_id
    check(pad_id is not None, key, "neither the model config nor the tokenizer defines a pad token")
    model.config.pad_token_id = int(pad_id)
    return model


def collate_pairs(pairs: list[Pair], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_BT, attention_mask_BT) of the 2P sequences: rows 0..P-1 the chosen, P..2P-1 the
    rejected ones, right-padded with ``pad_id``."""
    rows = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    T = max(len(r) for r in rows)
    ids_BT = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids_BT[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask_BT[b, : len(r)] = 1
    return ids_BT.to(device), mask_BT.to(device)


def score_pairs(model: torch.nn.Module, pairs: list[Pair], *, pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen_P, r_rejected_P) in fp32: both sequences of every pair in one forward."""
    ids_BT, mask_BT = collate_pairs(pairs, pad_id, device)
    r_B = model(input_ids=ids_BT, attention_mask=mask_BT, use_cache=False).logits[:, 0].float()
    return r_B[: len(pairs)], r_B[len(pairs) :]
