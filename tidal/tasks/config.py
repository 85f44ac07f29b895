"""Configuration of the built-in tasks (``task.*``)."""

from __future__ import annotations

import dataclasses

from tidal.config_base import check, check_choice

OPERATIONS = ("+", "-")


@dataclasses.dataclass(kw_only=True)
class TaskConfig:
    """A built-in task whose assets (data, tokenizer, warm-started model) Tidal builds locally.

    name: ``""`` for no built-in task (the run names its own model and data); ``"arithmetic"`` for
        the quickstart task (integer addition/subtraction, answer checked exactly).
    workdir: directory under which assets are built; each distinct setting of the fields below gets
        its own subdirectory (``arithmetic-<hash>``), so changing a setting never reuses stale assets.
    digits: operands are drawn uniformly from ``[0, 10**digits)``.
    operations: operators used, a non-empty subset of ``["+", "-"]`` (subtraction may go negative).
    fixed_width: write operands zero-padded to ``digits`` (``07+85``) and demonstrated answers to
        ``digits + 1`` (``092``, ``-048``), so digit positions line up; a tiny model then learns the
        task reliably within the SFT budget (without it, getting past the loss plateau in time
        depends on the seed). References stay plain integers (``"92"``).
    num_train / num_eval: distinct problems in the train and held-out eval sets (disjoint).
    hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size: the Qwen2 model shape.
    sft_steps / sft_lr / sft_batch_size: phase 1 of the supervised warm start, on correct
        demonstrations (AdamW, linear warmup over 10% of the steps then linear decay to zero; loss
        on answer tokens only). ``sft_steps = 0`` skips it.
    sft_mistake_steps / sft_mistake_rate: phase 2, same optimiser settings and a fresh schedule, on
        demonstrations of which a fraction ``sft_mistake_rate`` show the classic slip (carries
        dropped, or each digit's smaller taken from its larger) instead of the answer. The model
        keeps the procedure learnt in phase 1 but picks up the slip as a habit, so it usually
        slips greedily yet still samples the right answer now and then: an exact-match reward
        removes the habit quickly. ``sft_mistake_steps = 0`` skips it (a plain SFT model). The
        RL data always has the right answer.
    sft_threads: torch CPU threads used while building (restored afterwards).
    seed: seeds data sampling, model initialisation and SFT batching.
    """

    name: str = ""
    workdir: str = "~/.cache/tidal/tasks"
    digits: int = 2
    operations: list[str] = dataclasses.field(default_factory=lambda: ["+", "-"])
    fixed_width: bool = True
    num_train: int = 4000
    num_eval: int = 200
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    sft_steps: int = 1500
    sft_lr: float = 3e-3
    sft_batch_size: int = 128
    sft_mistake_steps: int = 500
    sft_mistake_rate: float = 0.75
    sft_threads: int = 2
    seed: int = 0

    def __post_init__(self):
        check_choice(self.name, ("", "arithmetic"), "name")
        check(bool(self.workdir), "workdir", "must be a directory path")
        check(1 <= self.digits <= 6, "digits", "must be in [1, 6]")
        check(len(self.operations) > 0, "operations", "must name at least one operation")
        for i, op in enumerate(self.operations):
            check_choice(op, OPERATIONS, f"operations[{i}]")
        check(len(set(self.operations)) == len(self.operations), "operations", "has duplicates")
        check(self.num_train >= 1, "num_train", "must be >= 1")
        check(self.num_eval >= 1, "num_eval", "must be >= 1")
        space = len(self.operations) * 10 ** (2 * self.digits)
        check(
            self.num_train + self.num_eval <= space,
            "num_train",
            f"num_train + num_eval = {self.num_train + self.num_eval} exceeds the {space} distinct problems "
            f"of {self.digits}-digit operands with operations {self.operations}",
        )
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            check(getattr(self, key) >= 1, key, "must be >= 1")
        check(self.hidden_size % self.num_heads == 0, "hidden_size", "must be divisible by num_heads")
        check((self.hidden_size // self.num_heads) % 2 == 0, "num_heads", "head dim hidden_size/num_heads must be even (RoPE)")
        check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", "must divide num_heads")
        check(self.sft_steps >= 0, "sft_steps", "must be >= 0")
        check(self.sft_mistake_steps >= 0, "sft_mistake_steps", "must be >= 0")
        check(self.sft_lr > 0, "sft_lr", "must be > 0")
        check(self.sft_batch_size >= 1, "sft_batch_size", "must be >= 1")
        check(0.0 <= self.sft_mistake_rate <= 1.0, "sft_mistake_rate", "must be in [0, 1]")
        check(self.sft_threads >= 1, "sft_threads", "must be >= 1")
