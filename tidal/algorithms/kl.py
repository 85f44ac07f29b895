"""KL estimators and KL-coefficient controllers.

Estimators of KL(pi || pi_ref) per token from samples of pi (Schulman, "Approximating KL
divergence", 2020), with log r = log pi_ref - log pi:
    k1 = -log r = logp - ref_logp            (unbiased, high variance, can be negative)
    k2 = (log r)^2 / 2                        (biased, low variance)
    k3 = (r - 1) - log r                      (unbiased, low variance, >= 0)
Robustness (as verl and OpenRLHF): log r is bounded to [-20, 20] before any estimator (so exp() in
k3 stays finite in float32, also for infinite inputs), and each token's estimate is then clamped to
[-clamp, clamp] (``algorithm.kl_clamp``, 10 by default; 0: no clamp): a token far from the
reference adds at most ``clamp`` to the KL and no gradient past it.
Controllers: fixed beta, or adaptive (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences"): beta <- beta * (1 + clip(KL / KL_target - 1, -0.2, 0.2) / horizon).
"""

from __future__ import annotations

import abc

from tidal.algorithms.registry import KL_ESTIMATORS
from tidal.lazy import lazy_module

torch = lazy_module("torch")

# exp() of larger log-ratios overflows float32 in k3; such tokens are already far off-policy.
_LOG_RATIO_BOUND = 20.0
DEFAULT_KL_CLAMP = 10.0


class KLEstimator(abc.ABC):
    """``clamp``: each token's estimate is clamped to [-clamp, clamp] (0: not clamped)."""

    def __init__(self, clamp: float = 0.0):
        self.clamp = float(clamp)

    def __call__(self, logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
        """Per-token estimate of KL(pi || pi_ref) at the sampled tokens (see the module docstring)."""
        log_r_BT = (ref_logp_BT - logp_BT).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        kl_BT = self.estimate(log_r_BT)
        return kl_BT.clamp(-self.clamp, self.clamp) if self.clamp > 0 else kl_BT

    @abc.abstractmethod
    def estimate(self, log_r_BT: torch.Tensor) -> torch.Tensor:
        """The estimator as a function of log r = log pi_ref - log pi (already bounded)."""


@KL_ESTIMATORS.register("k1")
class K1(KLEstimator):
    def estimate(self, log_r_BT):
        return -log_r_BT


@KL_ESTIMATORS.register("k2")
class K2(KLEstimator):
    def estimate(self, log_r_BT):
        return 0.5 * log_r_BT**2


@KL_ESTIMATORS.register("k3")
class K3(KLEstimator):
    def estimate(self, log_r_BT):
        return torch.exp(log_r_BT) - 1.0 - log_r_BT


class FixedKLController:
    """beta stays at its initial value."""

    def __init__(self, init_coef: float):
        self.value = float(init_coef)

    def update(self, current_kl: float) -> None:
        pass


class AdaptiveKLController:
    """beta follows the proportional rule of Ziegler et al. 2019 towards ``target`` per-token KL;
    ``horizon`` counts update() calls (their horizon in samples divided by samples per call)."""

    def __init__(self, init_coef: float, target: float, horizon: int):
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error / self.horizon


def make_kl_controller(cfg) -> FixedKLController | AdaptiveKLController:
    if cfg.kl_controller == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon_steps)
    return FixedKLController(cfg.kl_coef)
