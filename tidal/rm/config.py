"""Configuration of the reward-model job (``job: reward_model``): the ``reward_model.*`` section.

The job also reads the shared sections (``run``, ``model``, ``data``, ``strategy``, ``optim``, part
of ``train``, ``eval``, ``checkpoint``, ``logging``); which of their keys it reads, and the rule
that every other key keeps its default, live in :mod:`tidal.jobs`. Cross-section checks of this
job are in :func:`check_reward_model_job`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal.config_base import check, check_choice

TASKS = ("", "parity")


@dataclasses.dataclass(kw_only=True)
class PreferenceTaskConfig:
    """A built-in synthetic preference task whose assets Tidal builds locally (``reward_model.task.*``).

    name: ``""`` for none (the run names ``model.path`` and ``data.train``); ``"parity"``: prompts
        ask for an even or an odd number ("Write an odd number"); ``chosen`` is a number of the
        asked parity and ``rejected`` one of the other, both drawn at random. Telling them apart
        needs the prompt's word and the response's last digit: a task a tiny model learns in tens of
        steps, so pairwise accuracy rises from chance (0.5) to about 1.
    workdir: directory under which assets are built; each distinct setting of the fields below
        gets its own subdirectory (``parity-<hash>``) holding ``model/`` (a tokenizer and a randomly
        initialised tiny Qwen2 causal LM: the job adds the reward head), ``train.jsonl`` and
        ``eval.jsonl`` (rows ``{"prompt", "chosen", "rejected"}``).
    num_train / num_eval: preference pairs in the train and eval files.
    max_digits: responses have 1 to ``max_digits`` digits.
    hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size: the Qwen2 model shape.
    seed: seeds the data and the model's initialisation.
    """

    name: str = ""
    workdir: str = "~/.cache/tidal/tasks"
    num_train: int = 2000
    num_eval: int = 200
    max_digits: int = 3
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    seed: int = 0

    def __post_init__(self):
        check_choice(self.name, TASKS, "name")
        check(bool(self.workdir), "workdir", "must be a directory path")
        check(self.num_train >= 1, "num_train", "must be >= 1")
        check(self.num_eval >= 1, "num_eval", "must be >= 1")
        check(1 <= self.max_digits <= 9, "max_digits", "must be in [1, 9]")
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            check(getattr(self, key) >= 1, key, "must be >= 1")
        check(self.hidden_size % self.num_heads == 0, "hidden_size", "must be divisible by num_heads")
        check((self.hidden_size // self.num_heads) % 2 == 0, "num_heads", "head dim hidden_size/num_heads must be even (RoPE)")
        check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", "must divide num_heads")


@dataclasses.dataclass(kw_only=True)
class RewardModelConfig:
    """Reward-model training (``reward_model.*``, read only with ``job: reward_model``).

    The model is ``model.path`` loaded as ``AutoModelForSequenceClassification`` with one label (a
    causal LM gets a freshly initialised scalar head, seeded by ``run.seed``) and trained with the
    Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)`` on preference pairs.

    task: a built-in synthetic preference task (see :class:`PreferenceTaskConfig`).
    chosen_key / rejected_key: row fields of the preferred and the dispreferred response: each a
        string, or a list with one ``{"role": "assistant", "content": ...}`` message; with no
        prompt field (``data.prompt_key`` / ``data.messages_key``), both are whole conversations
        whose shared first messages are the prompt and whose last message is the response
        (implicit prompt), or two strings scored as they are.
    separator: text between the prompt text and the response text. A pair's two sequences are
        ``prompt + separator + chosen`` and ``prompt + separator + rejected``, the prompt rendered
        with the tokenizer's chat template and its generation prompt (``data.apply_chat_template``),
        tokenised by the model's tokenizer exactly as the ``type: model`` reward component
        tokenises what it scores; the export records the separator, and an RL run that loads the
        export uses it.
    max_length: most tokens of one sequence (prompt, separator and response).
    overlong: a pair with a longer sequence: ``error`` (raise naming the file and line), ``drop``
        (leave the pair out, counted) or ``left_truncate`` (keep the last ``max_length`` tokens, as
        the reward component does when it scores: the response survives, the prompt's start goes).
    bad_pairs: a row with a missing or malformed prompt, chosen or rejected field, or whose chosen
        and rejected responses are identical: ``error`` (raise naming the file and line) or
        ``skip`` (leave it out, counted by kind and printed at start).
    batch_pairs: pairs per optimizer step over all ranks (a multiple of WORLD_SIZE); each step's
        loss is the mean over them, computed in micro-batches of ``train.micro_batch_tokens`` /
        ``train.micro_batch_max_seqs`` (both sequences of a pair go in the same micro-batch).
        ``run.steps`` counts optimizer steps; the data is reshuffled each epoch (``data.shuffle``).
    center_rewards_coef: adds ``coef * mean((r_chosen + r_rejected)**2)``, which pulls the rewards
        towards zero mean (Eisenstein et al. 2023, arXiv:2312.09244; TRL's
        ``center_rewards_coefficient``); 0 turns it off.
    export_at_end: write the trained model as a Hugging Face folder to ``<run.output_dir>/export``
        at the end of training (``tidal export`` writes one from any checkpoint).
    """

    task: PreferenceTaskConfig = dataclasses.field(default_factory=PreferenceTaskConfig)
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    separator: str = ""
    max_length: int = 1024
    overlong: Literal["error", "drop", "left_truncate"] = "error"
    bad_pairs: Literal["error", "skip"] = "error"
    batch_pairs: int = 64
    center_rewards_coef: float = 0.0
    export_at_end: bool = True

    def __post_init__(self):
        check(bool(self.chosen_key), "chosen_key", "must be a non-empty field name")
        check(bool(self.rejected_key), "rejected_key", "must be a non-empty field name")
        check(self.chosen_key != self.rejected_key, "rejected_key", f"must differ from chosen_key ({self.chosen_key!r})")
        check(self.max_length >= 2, "max_length", f"must be >= 2, got {self.max_length}")
        check(self.batch_pairs >= 1, "batch_pairs", f"must be >= 1, got {self.batch_pairs}")
        check(self.center_rewards_coef >= 0, "center_rewards_coef", f"must be >= 0, got {self.center_rewards_coef}")


def check_reward_model_job(cfg) -> None:
    """Checks across sections for ``job: reward_model`` (``cfg`` is the root ``TidalConfig``)."""
    rm, data = cfg.reward_model, cfg.data
    if rm.task.name:
        check(not cfg.model.path, "model.path", f"must be empty with reward_model.task.name={rm.task.name!r}: the task builds the model")
        check(not data.train, "data.train", f"must be empty with reward_model.task.name={rm.task.name!r}: the task builds the data")
    else:
        check(bool(cfg.model.path), "model.path", "must be a local Hugging Face model folder (or set reward_model.task.name)")
        check(bool(data.train), "data.train", "needs at least one preference-pair source (or set reward_model.task.name)")
    for key in ("chosen_key", "rejected_key"):
        name = getattr(rm, key)
        check(name not in (data.prompt_key, data.messages_key), f"reward_model.{key}",
              f"'{name}' is already data.prompt_key or data.messages_key")
    _check_unused(cfg)
    check(cfg.train.micro_batch_max_seqs >= 2, "train.micro_batch_max_seqs", "must be >= 2 for job=reward_model (a pair is two sequences)")
    check(cfg.train.forward_micro_batch_max_seqs >= 2, "train.forward_micro_batch_max_seqs",
          "must be >= 2 for job=reward_model (a pair is two sequences)")


def check_reward_model_world(cfg, world_size: int) -> None:
    check(
        cfg.reward_model.batch_pairs % world_size == 0, "reward_model.batch_pairs",
        f"({cfg.reward_model.batch_pairs}) must be divisible by WORLD_SIZE ({world_size}) so every rank gets the same number of pairs",
    )


def _check_unused(cfg) -> None:
    """Keys of read sections that this run still never reads (no silent ignores): the task's
    settings without a task, the W&B settings without the wandb backend."""
    task, defaults = cfg.reward_model.task, PreferenceTaskConfig()
    unused = []
    if not task.name:
        unused += [(f"reward_model.task.{f.name}", getattr(task, f.name), getattr(defaults, f.name), "a built-in task (reward_model.task.name)")
                   for f in dataclasses.fields(PreferenceTaskConfig) if f.name not in ("name", "workdir")]
    if "wandb" not in cfg.logging.backends:
        unused += [("logging.wandb_project", cfg.logging.wandb_project, "tidal", "logging.backends with wandb"),
                   ("logging.wandb_mode", cfg.logging.wandb_mode, "offline", "logging.backends with wandb")]
    for key, value, default, used_by in unused:
        check(value == default, key, f"is only used by {used_by}; leave it at its default ({default!r}) in this run")
