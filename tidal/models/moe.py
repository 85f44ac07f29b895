"""The trainer side of mixture-of-experts models: one tap on the routers of an HF MoE model.

:class:`RouterTap` holds a forward hook on every router (``mlp.gate`` of the sparse layers, in layer
order; the ``transformers`` 5 routers return ``(router_logits, top_k_weights, top_k_index)``). During a
forward it keeps each MoE layer's router logits (for the load-balancing loss) and the experts the
trainer's router chose (for ``moe/router_agreement``); with routing replay it replaces the chosen
experts by the rollout engine's and recomputes their gate weights from the trainer's own logits
(:func:`tidal.models.routing.replay_weights`), so the experts are the engine's and the
router still gets gradient. The hooks also fire when gradient checkpointing recomputes a layer in
backward: the replay stays set until the next :meth:`RouterTap.start`, so the recomputed routing is the
replayed one.

Layout of a forward's rows: the router sees ``N`` rows, the packed row of a
:class:`~tidal.models.packing.PackedBatch` (real tokens first, then the dummy sequence) or the padded
``[B, T]`` batch flattened. ``valid_N`` marks the real tokens; ``replay_NLK`` (int, ``-1``: route this
token itself) gives per row and MoE layer the ``K`` experts to use.

Routing replay data: ``routed_BTLK`` (int16 ``[B, T, L, K]``, ``-1`` where the engine did not route the
token: the last token of a sequence, padding) aligned with ``Experience.sequences_BT``.
"""

from __future__ import annotations

import functools
import sys

import torch

from tidal import families
from tidal.models.routing import replay_weights


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of an HF MoE causal LM (also wrapped: PEFT, FSDP2), in layer order; empty for
    a dense model. A router is a ``mlp.gate`` module whose MoE block has ``experts``."""
    routers = []
    for name, module in model.named_modules():
        parent_name, _, leaf = name.rpartition(".")
        if leaf == "gate" and parent_name.endswith("mlp") and hasattr(model.get_submodule(parent_name), "experts"):
            for attr in ("top_k", "num_experts"):
                if not hasattr(module, attr):
                    raise NotImplementedError(f"{name} ({type(module).__name__}): only softmax top-k routers with "
                                              f"top_k and num_experts are supported in training")
            routers.append(module)
    return routers


def renormalises_top_k(model: torch.nn.Module, router: torch.nn.Module) -> bool:
    """Whether ``router`` renormalises its top-k weights: its own ``norm_topk_prob`` (Qwen3-MoE,
    OLMoE), else its family's router kind (Qwen3.5-MoE's router always renormalises and has no such
    attribute; :class:`~tidal.families.MoEShape`)."""
    if hasattr(router, "norm_topk_prob"):
        return bool(router.norm_topk_prob)
    config = getattr(model, "config", None)
    family = families.find_family(config) if config is not None else None
    shape = family.moe(families.text_config(config)) if family is not None else None
    if shape is None:
        raise NotImplementedError(f"{type(router).__name__} has no norm_topk_prob and its model is of no MoE family "
                                  "Tidal knows: its routing cannot be replayed in training")
    return shape.router == "softmax_topk_renorm"


class RouterTap:
    """Hooks on ``routers`` (see the module docstring). ``start`` before a forward, ``aux_loss`` /
    ``agreement`` after it. ``norm_topk_prob``: whether the routers renormalise their top-k weights
    (:func:`renormalises_top_k`), as replayed weights must too."""

    def __init__(self, routers: list[torch.nn.Module], *, norm_topk_prob: bool):
        if not routers:
            raise ValueError("RouterTap needs at least one router (a dense model has none)")
        self.routers, self.norm_topk_prob = routers, norm_topk_prob
        self.num_experts, self.top_k = routers[0].num_experts, routers[0].top_k
        self.logits: dict[int, torch.Tensor] = {}
        self.chosen: dict[int, torch.Tensor] = {}
        self.replay_NLK: torch.Tensor | None = None
        for layer, router in enumerate(routers):
            router.register_forward_hook(functools.partial(self._hook, layer))
        self._balance_loss = getattr(sys.modules[type(routers[0]).__module__], "load_balancing_loss_func", None)
        if self._balance_loss is None:
            raise NotImplementedError(f"{type(routers[0]).__module__} has no load_balancing_loss_func")

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def start(self, replay_NLK: torch.Tensor | None = None) -> None:
        """Forget the last forward's routing; replay ``replay_NLK`` in the next forward (and its
        recomputation in backward), or route freely with None."""
        if replay_NLK is not None and tuple(replay_NLK.shape[1:]) != (self.num_layers, self.top_k):
            raise ValueError(f"routing replay of shape {tuple(replay_NLK.shape)}: this model has {self.num_layers} MoE "
                             f"layers of top-{self.top_k} routing ([N, {self.num_layers}, {self.top_k}] expected)")
        self.logits.clear()
        self.chosen.clear()
        self.replay_NLK = replay_NLK

    def _hook(self, layer: int, module, args, output):
        logits_NE, _, experts_NK = output
        self.logits[layer] = logits_NE
        self.chosen[layer] = experts_NK.detach()
        if self.replay_NLK is None:
            return None
        replay_NK = self.replay_NLK[:, layer].to(experts_NK.device)
        if replay_NK.shape[0] != experts_NK.shape[0]:
            raise ValueError(f"routing replay has {replay_NK.shape[0]} rows, the forward {experts_NK.shape[0]}")
        own_N1 = replay_NK[:, :1] < 0
        experts_NK = torch.where(own_N1, experts_NK, replay_NK.long())
        return logits_NE, replay_weights(logits_NE, experts_NK, self.norm_topk_prob), experts_NK

    def _layers(self) -> list[int]:
        if len(self.logits) != self.num_layers:
            raise RuntimeError(f"the last forward ran {len(self.logits)} of {self.num_layers} MoE layers")
        return list(range(self.num_layers))

    def aux_loss(self, valid_N: torch.Tensor) -> torch.Tensor:
        """The family's load-balancing loss over every MoE layer's router logits of the last forward,
        on the rows ``valid_N`` marks (differentiable in the router weights)."""
        logits = tuple(self.logits[l] for l in self._layers())
        mask_1N = valid_N.to(logits[0].device, torch.float32)[None]
        return self._balance_loss(logits, self.num_experts, self.top_k, mask_1N)

    def agreement(self, routed_NLK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(matching, compared): over the rows and layers the engine routed (``routed_NLK >= 0``), how
        many of the trainer's own top-k *sets* (before any replay) equal the engine's, and how many
        were compared (device scalars)."""
        chosen_NLK = torch.stack([self.chosen[l] for l in self._layers()], dim=1)
        routed_NLK = routed_NLK.to(chosen_NLK.device).long()
        same_NL = (chosen_NLK.sort(-1).values == routed_NLK.sort(-1).values).all(-1)
        have_NL = routed_NLK[..., 0] >= 0
        return (same_NL & have_NL).sum(), have_NL.sum()


def router_tap(model: torch.nn.Module) -> RouterTap | None:
    """A tap on ``model``'s routers, None for a dense model."""
    routers = find_routers(model)
    return RouterTap(routers, norm_topk_prob=renormalises_top_k(model, routers[0])) if routers else None


class MoETraining:
    """What the trainer does for an MoE actor, per forward: ``begin`` (replay the engine's routing of
    the micro-batch when ``replay``), then ``after_forward`` for the load-balancing loss to add
    (``aux_loss_coef`` times it) and the routing metrics. ``tap``: the actor's :class:`RouterTap`."""

    def __init__(self, tap: RouterTap, *, aux_loss_coef: float, replay: bool):
        self.tap, self.aux_loss_coef, self.replay = tap, float(aux_loss_coef), replay

    def begin(self, packed, routed_BTLK: torch.Tensor | None) -> None:
        """Before a packed forward (:class:`~tidal.models.packing.PackedBatch` on the device) of rows
        whose engine routing is ``routed_BTLK`` (None: not recorded)."""
        if self.replay and routed_BTLK is None:
            raise ValueError("moe.routing_replay=rollout: the experience has no engine routing (the native engine "
                             "records it for MoE models; partial rollout and the hf/vllm/sglang engines do not)")
        replay = packed.pack(routed_BTLK.to(packed.input_ids_1N.device), fill=-1) if self.replay else None
        self.tap.start(replay)

    def after_forward(self, packed, routed_BTLK: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the load-balancing loss of the forward's real tokens, its metrics): ``aux_loss`` (the
        family's balance loss), ``aux_loss_term`` (``aux_loss_coef`` times it: what the policy loss gets,
        0 when the coefficient is) and, with engine routing, ``router_agreement`` (the fraction of the
        token-layers the engine routed where the trainer's own top-k set is the engine's). The trainer
        logs them as ``moe/<name>``, averaged over micro-batches by their response tokens, as every
        policy metric."""
        valid_N = torch.arange(packed.num_tokens, device=packed.input_ids_1N.device) < packed.num_real
        aux = self.tap.aux_loss(valid_N)
        metrics = {"aux_loss": aux.detach(), "aux_loss_term": self.aux_loss_coef * aux.detach()}
        if routed_BTLK is not None:
            same, compared = self.tap.agreement(packed.pack(routed_BTLK.to(valid_N.device), fill=-1))
            metrics["router_agreement"] = same / compared.clamp_min(1)
        return aux, metrics


def moe_training(model: torch.nn.Module, cfg, hf_config) -> MoETraining | None:
    """The trainer's MoE handling of the actor ``model`` under ``cfg`` (:class:`~tidal.models.config.MoEConfig`),
    None for a dense model. ``aux_loss_coef: auto`` is the model config's ``router_aux_loss_coef``."""
    tap = router_tap(model)
    if tap is None:
        return None
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    coef = getattr(text, "router_aux_loss_coef", 0.0) if cfg.aux_loss_coef == "auto" else cfg.aux_loss_coef
    return MoETraining(tap, aux_loss_coef=coef, replay=cfg.routing_replay == "rollout")
