"""Configuration of the built-in tasks (``task.*``): the arithmetic quickstart (its settings at the
top of ``task``) and the calculator tool-use task (``task.calculator.*``)."""

from __future__ import annotations

import dataclasses

from tidal.config_base import check, check_choice
from tidal.tasks.architectures import ARCHITECTURES

OPERATIONS = ("+", "-")
TASKS = ("", "arithmetic", "calculator")
# Settings of the arithmetic task (the top of ``task``); the calculator task reads task.calculator.*
ARITHMETIC_SETTINGS = ("digits", "operations", "fixed_width", "num_train", "num_eval", "architecture", "hidden_size", "num_layers", "num_heads",
                       "num_kv_heads", "intermediate_size", "sft_steps", "sft_lr", "sft_batch_size", "sft_mistake_steps",
                       "sft_mistake_rate", "seed")


@dataclasses.dataclass(kw_only=True)
class CalculatorTaskConfig:
    """Settings of the calculator task (``task.calculator.*``; built under
    ``task.workdir/calculator-<hash of these settings>`` with ``task.sft_threads`` threads).

    a_digits / b_digits: digits of the two factors (``a`` in ``[10**(a_digits-1), 10**a_digits)``).
    num_train / num_eval: distinct problems of the train and held-out sets (disjoint).
    hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size: the Qwen2 shape.
    sft_steps / sft_lr / sft_batch_size: phase 1 of the warm start, on tool demonstrations (AdamW,
        linear warmup over 10% of the steps, then linear decay). ``sft_steps = 0`` skips it.
    sft_direct_steps / direct_rate: phase 2 (same optimiser settings, a fresh schedule), on
        demonstrations of which a fraction ``direct_rate`` answer directly, without the tool (with
        the right product, which the model cannot compute: the habit RL must remove).
        ``sft_direct_steps = 0`` skips it.
    seed: data, initialisation and batching.
    """

    a_digits: int = 2
    b_digits: int = 2
    num_train: int = 3000
    num_eval: int = 100
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    sft_steps: int = 400
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    sft_direct_steps: int = 150
    direct_rate: float = 0.7
    seed: int = 0
    name: str = dataclasses.field(default="calculator", init=False)

    def __post_init__(self):
        check(1 <= self.a_digits <= 6, "a_digits", "must be in [1, 6]")
        check(1 <= self.b_digits <= 6, "b_digits", "must be in [1, 6]")
        check(self.num_train >= 1 and self.num_eval >= 1, "num_train", "num_train and num_eval must be >= 1")
        space = 9 * 10 ** (self.a_digits - 1) * 9 * 10 ** (self.b_digits - 1)
        check(self.num_train + self.num_eval <= space, "num_train", f"num_train + num_eval exceeds the {space} distinct problems")
        check(0.0 <= self.direct_rate <= 1.0, "direct_rate", "must be in [0, 1]")
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "sft_batch_size"):
            check(getattr(self, key) >= 1, key, "must be >= 1")
        check(self.hidden_size % self.num_heads == 0 and (self.hidden_size // self.num_heads) % 2 == 0, "num_heads",
              "hidden_size / num_heads must be an even integer")
        check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", "must divide num_heads")
        check(self.sft_steps >= 0, "sft_steps", "must be >= 0")
        check(self.sft_direct_steps >= 0, "sft_direct_steps", "must be >= 0")
        check(self.sft_lr > 0, "sft_lr", "must be > 0")


@dataclasses.dataclass(kw_only=True)
class TaskConfig:
    """A built-in task whose assets (data, tokenizer, warm-started model) Tidal builds locally.

    name: ``""`` for no built-in task (the run names its own model and data); ``"arithmetic"`` for
        the quickstart task (integer addition/subtraction, answer checked exactly, the settings
        below); ``"calculator"`` for the tool-use task (a tiny model learns to call a calculator
        tool, settings in ``calculator``; run it with the ``calculator`` environment, as the
        shipped ``calculator`` config does). Setting the other task's settings is an error.
    workdir: directory under which assets are built; each distinct setting of the task's fields gets
        its own subdirectory (``arithmetic-<hash>``, ``calculator-<hash>``), so changing a setting
        never reuses stale assets.
    digits: operands are drawn uniformly from ``[0, 10**digits)``.
    operations: operators used, a non-empty subset of ``["+", "-"]`` (subtraction may go negative).
    fixed_width: write operands zero-padded to ``digits`` (``07+85``) and demonstrated answers to
        ``digits + 1`` (``092``, ``-048``), so digit positions line up; a tiny model then learns the
        task reliably within the SFT budget (without it, getting past the loss plateau in time
        depends on the seed). References stay plain integers (``"92"``).
    num_train / num_eval: distinct problems in the train and held-out eval sets (disjoint).
    architecture: the model family built (:data:`tidal.tasks.architectures.ARCHITECTURES`: ``qwen2``,
        ``qwen3``, ``llama``, ``gemma3``, ``olmo3``, ``qwen3_moe``, ``qwen3_5_moe``), tiny and randomly
        initialised, then warm-started. The sliding-window families (Gemma 3, OLMo 3) slide every layer
        but the last over 8 tokens; ``qwen3_moe`` is a mixture of experts in every layer (8 experts of
        ``intermediate_size / 2``, top-2 renormalised; docs/moe.md); ``qwen3_5_moe`` the hybrid
        Qwen3.5 with those experts and a shared expert.
    hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size: the model's shape.
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
    sft_threads: torch CPU threads used while building either task (restored afterwards). 0
        (default): the run's threads, by the rule of ``run.cpu_threads``
        (:func:`tidal.distributed.runtime.cpu_threads`: half the cores on an idle machine's share).
    seed: seeds data sampling, model initialisation and SFT batching.
    calculator: the calculator task's settings (:class:`CalculatorTaskConfig`).
    """

    name: str = ""
    workdir: str = "~/.cache/tidal/tasks"
    digits: int = 2
    operations: list[str] = dataclasses.field(default_factory=lambda: ["+", "-"])
    fixed_width: bool = True
    num_train: int = 4000
    num_eval: int = 200
    architecture: str = "qwen2"
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
    sft_threads: int = 0
    seed: int = 0
    calculator: CalculatorTaskConfig = dataclasses.field(default_factory=CalculatorTaskConfig)

    def __post_init__(self):
        check_choice(self.name, TASKS, "name")
        check_choice(self.architecture, sorted(ARCHITECTURES), "architecture")
        self._check_other_task_untouched()
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
        check(self.sft_threads >= 0, "sft_threads", "must be >= 0 (0: the run's threads, run.cpu_threads)")

    def _check_other_task_untouched(self) -> None:
        """A setting of the task not chosen would do nothing: refuse it, naming the key."""
        if self.name == "calculator":
            fields = {f.name: f for f in dataclasses.fields(TaskConfig)}
            for key in ARITHMETIC_SETTINGS:
                f = fields[key]
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                check(getattr(self, key) == default, key,
                      f"is a setting of the arithmetic task; with task.name=calculator set task.calculator.{key} "
                      "instead (where it exists)")
        else:
            default = CalculatorTaskConfig()
            for f in dataclasses.fields(CalculatorTaskConfig):
                check(getattr(self.calculator, f.name) == getattr(default, f.name), f"calculator.{f.name}",
                      f"is a setting of the calculator task, but task.name={self.name!r}")
