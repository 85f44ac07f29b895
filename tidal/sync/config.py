"""Configuration of weight sync and its checks (``sync.*``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from tidal.config_base import check


@dataclasses.dataclass(kw_only=True)
class SyncConfig:
    """How the engine is kept in step with the actor, and how staleness is caught (``sync.*``).

    verify: after every weight sync, the engine reads back each bucket of weights it was sent and
        compares it with what was sent (exact; one device read of the weights per sync); a
        mismatch stops the run naming the weights (``WeightSyncError``). Engines that cannot read
        their weights back (the vLLM and SGLang adapters) are covered by the alarm below only.
    max_logp_diff: alarm threshold on the mean |log pi_trainer - log pi_rollout| per sampled token
        (``mismatch/abs_logp_diff_mean`` or ``actor/mismatch_abs_logp_diff``, measured every step):
        an engine that generates with other weights than the trainer's shows up there. 0 turns the
        alarm off. bf16 engines typically differ by 0.01-0.05 from the trainer.
    on_alarm: ``warn`` (one line on rank 0, ``sync/alarms`` counted) or ``stop`` (raise naming the
        value and the threshold).
    """

    verify: bool = True
    max_logp_diff: float = 0.5
    on_alarm: Literal["warn", "stop"] = "warn"

    def __post_init__(self):
        check(self.max_logp_diff >= 0 and math.isfinite(self.max_logp_diff), "max_logp_diff",
              "must be a finite number >= 0 (0: no alarm)")
