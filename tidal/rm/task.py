"""The built-in synthetic preference task (``reward_model.task``): parity preferences.

A prompt asks for a number of one parity ("Write an odd number"); ``chosen`` is a random number of
that parity and ``rejected`` a random number of the other, each of 1 to ``max_digits`` digits. The
reward must read the prompt's word and the response's last digit. Rows are explicit-prompt pairs
``{"prompt", "chosen", "rejected"}``.

Built once under ``{workdir}/parity-<hash of the settings>/`` (``model/``: the quickstart's
byte-level BPE tokenizer with its chat template and a randomly initialised tiny Qwen2 causal LM;
``train.jsonl``, ``eval.jsonl``; ``task.json`` written last), in a temporary sibling renamed into
place, so a folder that exists is complete. Call :func:`prepare` on one rank and barrier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tidal.config_base import to_dict
from tidal.rm.config import PreferenceTaskConfig
from tidal.tasks.store import MARKER, ensure_built
from tidal.tasks.tokenizer import save_tokenizer, train_tokenizer

BUILD_VERSION = 1  # part of the asset hash: bump whenever the same settings would build different assets
VERBS = ("Say", "Write", "Give", "Name", "Pick")
MAX_POSITIONS = 64


@dataclasses.dataclass(kw_only=True, frozen=True)
class PreferenceTaskAssets:
    model_path: str
    train_path: str
    eval_path: str


def parity_rows(n: int, *, max_digits: int, seed: int) -> list[dict]:
    """``n`` pairs (see the module docstring); the same arguments give the same rows."""
    rng = random.Random(seed)

    def number(parity: int) -> str:
        digits = rng.randint(1, max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        value = rng.randrange(low, 10**digits)
        if value % 2 != parity:  # step to the neighbour of the right parity, staying within the digits
            value += 1 if value + 1 < 10**digits else -1
        return str(value)

    rows = []
    for _ in range(n):
        parity = rng.randint(0, 1)
        prompt = f"{rng.choice(VERBS)} an {'odd' if parity else 'even'} number"
        rows.append({"prompt": prompt, "chosen": number(parity), "rejected": number(1 - parity)})
    return rows


def settings_hash(cfg: PreferenceTaskConfig) -> str:
    settings = {k: v for k, v in to_dict(cfg).items() if k != "workdir"}
    settings["build_version"] = BUILD_VERSION
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def asset_dir(cfg: PreferenceTaskConfig) -> Path:
    return Path(cfg.workdir).expanduser() / f"{cfg.name}-{settings_hash(cfg)}"


def prepare(cfg: PreferenceTaskConfig) -> PreferenceTaskAssets:
    """The task's assets, built first unless a complete build exists."""
    root = ensure_built(cfg, asset_dir(cfg), _build, key="reward_model.task.workdir")
    return PreferenceTaskAssets(model_path=str(root / "model"), train_path=str(root / "train.jsonl"), eval_path=str(root / "eval.jsonl"))


def build_model(cfg: PreferenceTaskConfig, tokenizer) -> Qwen2ForCausalLM:
    """A randomly initialised fp32 Qwen2 causal LM of ``cfg``'s shape (seeded by ``cfg.seed``)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    return Qwen2ForCausalLM(config)


def _build(cfg: PreferenceTaskConfig, out: Path) -> None:
    train = parity_rows(cfg.num_train, max_digits=cfg.max_digits, seed=cfg.seed)
    held_out = parity_rows(cfg.num_eval, max_digits=cfg.max_digits, seed=cfg.seed + 1)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_tokenizer(r["prompt"] + " " + r["chosen"] + " " + r["rejected"] for r in train)
    build_model(cfg, tokenizer).save_pretrained(out / "model")
    save_tokenizer(tokenizer, str(out / "model"))
    (out / MARKER).write_text(json.dumps({"settings": to_dict(cfg)}, indent=2))
