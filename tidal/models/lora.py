"""LoRA actors (PEFT): adapters on the actor, its base as the reference, merged weights for the engine.

Contract:
- A LoRA model is a ``peft.PeftModel``, or a training engine that holds one as ``.module`` and
  forwards attribute access to it (a ``DeepSpeedEngine``): :func:`peft_model` finds it, so the
  functions here take either.
- :func:`apply_lora` wraps an HF causal LM in a ``peft.PeftModel`` whose only trainable parameters
  are the adapters (``lora_A``/``lora_B`` of the ``model.lora.target_modules`` linears); with LoRA
  off it returns the model unchanged. The Tidal logprob method is attached to the PEFT model (the
  FSDP root) and computes with the HF model inside it.
- :func:`adapter_disabled_reference` is the KL reference of a LoRA actor: the same modules run with
  the adapters disabled (``PeftModel.disable_adapter``). It owns no weights, so offloading it moves
  nothing and there is no second copy of the base.
- :func:`hf_weights` yields the actor's weights under their Hugging Face names, a LoRA target's
  weight merged on the fly as ``W + (alpha / r) * B @ A`` (one layer at a time, in fp32): the
  engine never sees a PEFT name. Without LoRA it is the parameters as they are.
- :func:`save_hf` writes an HF folder (merged weights for LoRA, loadable by ``from_pretrained``)
  and, for LoRA, the adapters in PEFT's ``save_pretrained`` format under ``adapter/``.

This module owns every PEFT parameter name; callers only see HF names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import torch

from tidal.models.config import LoraConfig
from tidal.models.logprobs import LOGPROB_METHOD, attach_logprob_method

ADAPTER = "default"
ADAPTER_DIR = "adapter"
_PEFT_PREFIX = "base_model.model."


def peft_model(model: torch.nn.Module):
    """The ``PeftModel`` of ``model``: itself, or the module a training engine wraps (``.module``
    of a ``DeepSpeedEngine``); None for a model without LoRA."""
    try:
        from peft import PeftModel
    except ImportError:  # without PEFT installed no model can be a LoRA model
        return None
    for m in (model, getattr(model, "module", None)):
        if isinstance(m, PeftModel):
            return m
    return None


def is_lora(model: torch.nn.Module) -> bool:
    return peft_model(model) is not None


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, *, seed: int = 0) -> torch.nn.Module:
    """``model`` with LoRA adapters (only they train), or ``model`` itself when ``cfg.rank == 0``.
    The adapters' initial values depend on ``seed`` alone (not on the global RNG state)."""
    if not cfg.enabled:
        return model
    from tidal.optional_deps import require

    require("lora", "model.lora.rank", "LoRA (model.lora.rank > 0)")
    import peft

    targets = cfg.targets(model.config)
    experts = {"target_parameters": list(cfg.target_parameters)} if cfg.target_parameters else {}
    if experts and "target_parameters" not in {f.name for f in dataclasses.fields(peft.LoraConfig)}:
        raise ValueError(f"model.lora.target_parameters={list(cfg.target_parameters)}: PEFT {peft.__version__} cannot "
                         "adapt stacked expert parameters (target_parameters needs peft >= 0.17); upgrade peft or leave it empty")
    peft_cfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none",
                               **experts)
    if getattr(model, "is_gradient_checkpointing", False):
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapped = peft.get_peft_model(model, peft_cfg, adapter_name=ADAPTER)
    except ValueError as e:
        raise ValueError(f"model.lora.target_modules={targets}, model.lora.target_parameters={list(cfg.target_parameters)}: "
                         f"{e}") from None
    attach_logprob_method(wrapped, wrapped.get_base_model())
    return wrapped


class AdapterDisabledReference(torch.nn.Module):
    """The base model of a LoRA actor, for reference logprobs: the actor's own modules with the
    adapters disabled. It registers no submodule or parameter (the actor is held as a plain
    attribute), so ``to()``/offloading it is a no-op and it is never a second copy. ``actor`` is
    what the strategy prepared (the PEFT model, or the engine wrapping it): the logprobs run
    through it, so a ZeRO-3 engine gathers the base weights as for the actor's own forward."""

    def __init__(self, actor: torch.nn.Module):
        super().__init__()
        peft = peft_model(actor)
        if peft is None:
            raise ValueError("AdapterDisabledReference needs a LoRA (PEFT) actor")
        object.__setattr__(self, "_actor", actor)
        object.__setattr__(self, "_peft", peft)
        object.__setattr__(self, LOGPROB_METHOD, self._base_logprobs)  # what token_logprobs() calls

    def _base_logprobs(self, *args):
        with self._peft.disable_adapter():
            return getattr(self._actor, LOGPROB_METHOD)(*args)


def adapter_disabled_reference(actor: torch.nn.Module) -> AdapterDisabledReference:
    return AdapterDisabledReference(actor)


# ---- HF-named (merged) weights -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WeightEntry:
    """One HF weight: ``source`` in the (possibly PEFT) model, plus the adapter that merges into it."""

    hf_name: str
    source: str
    lora_a: str | None = None
    lora_b: str | None = None
    scaling: float = 0.0
    experts: int = 0  # a stacked-experts parameter ([E, ...], PEFT ``target_parameters``): its expert count
    swapped: bool = False  # ... stored [E, out, in] (PEFT's ``_did_swap_in_out_features``), else [E, in, out]

    @property
    def params(self) -> tuple[str, ...]:
        """Names of the model parameters this weight is computed from."""
        return (self.source,) if self.lora_a is None else (self.source, self.lora_a, self.lora_b)


def hf_name(peft_name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` -> ``model.layers.0.self_attn.q_proj.weight``."""
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    while ".base_layer." in name:  # a parameter adapted twice (two target_parameters of one module) is nested twice
        name = name.replace(".base_layer.", ".")
    return name


def weight_plan(model: torch.nn.Module) -> list[WeightEntry]:
    """Every HF weight of ``model`` in ``named_parameters`` order (a tied weight once), with the
    adapter parameters that merge into it. The same on every rank."""
    names = {id(p): n for n, p in model.named_parameters()}
    merges: dict[str, dict] = {}
    adapter_params: set[str] = set()
    if is_lora(model):
        from peft.tuners.lora import LoraLayer, ParamWrapper

        for _, m in model.named_modules():
            if not isinstance(m, LoraLayer) or ADAPTER not in m.lora_A:
                continue
            a, b = names[id(m.lora_A[ADAPTER].weight)], names[id(m.lora_B[ADAPTER].weight)]
            adapter_params.update((a, b))
            if isinstance(m, ParamWrapper):  # model.lora.target_parameters: a stacked-experts parameter
                merges[names[id(m.get_param())]] = dict(lora_a=a, lora_b=b, scaling=float(m.scaling[ADAPTER]),
                                                         experts=int(m.num_experts), swapped=bool(m._did_swap_in_out_features))
                continue
            if not isinstance(m.get_base_layer(), torch.nn.Linear):
                raise ValueError(f"LoRA on {type(m.get_base_layer()).__name__} is not supported (nn.Linear only); check model.lora.target_modules")
            merges[names[id(m.get_base_layer().weight)]] = dict(lora_a=a, lora_b=b, scaling=float(m.scaling[ADAPTER]))
    plan = []
    for name in names.values():
        if name in adapter_params:
            continue
        if ".lora_" in name:
            raise ValueError(f"unsupported adapter parameter {name!r} (only plain LoRA on nn.Linear)")
        plan.append(WeightEntry(hf_name=hf_name(name), source=name, **merges.get(name, {})))
    return plan


def merged(entry: WeightEntry, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The full HF weight of ``entry``; ``get(name)`` returns the full tensor of a model parameter."""
    w = get(entry.source)
    if entry.lora_a is None:
        return w
    a_RI, b_OR = get(entry.lora_a), get(entry.lora_b)
    # in fp32, returned in the wider of the base's and the adapters' dtypes (a bf16 base with fp32
    # adapters stays fp32 until the caller casts it once)
    out_dtype = torch.promote_types(w.dtype, a_RI.dtype)
    if entry.experts:  # PEFT's ParamWrapper: A [E*r, in] and B [out, r*E], one adapter per expert
        E = entry.experts
        a_ERI = a_RI.float().reshape(E, -1, a_RI.shape[-1])
        b_ORE = b_OR.float().reshape(b_OR.shape[0], -1, E)
        delta = torch.einsum("ore,eri->eoi" if entry.swapped else "ore,eri->eio", b_ORE, a_ERI)
        return (w.float() + entry.scaling * delta).to(out_dtype)
    return (w.float() + entry.scaling * (b_OR.float() @ a_RI.float())).to(out_dtype)


def hf_weights(model: torch.nn.Module, full: Callable[[torch.nn.Parameter], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight, LoRA merged; ``full(param)`` gathers one parameter
    (a collective for sharded parameters: every rank walks the same plan in the same order)."""
    params = dict(model.named_parameters())
    for entry in weight_plan(model):
        yield entry.hf_name, merged(entry, lambda n: full(params[n]))


def merged_state_dict(model: torch.nn.Module, full_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named, LoRA-merged state dict from ``model``'s full state dict (e.g. on rank 0 for export)."""
    sd = {e.hf_name: merged(e, full_sd.__getitem__) for e in weight_plan(model)}
    for name, _ in model.named_buffers():  # persistent buffers keep their values, under HF names
        if name in full_sd:
            sd[hf_name(name)] = full_sd[name]
    return sd


# ---- export ----------------------------------------------------------------------------------------------
def save_hf(model: torch.nn.Module, full_sd: dict[str, torch.Tensor], out: Path) -> None:
    """Write ``out`` as an HF folder loadable by ``from_pretrained`` (LoRA merged into the weights)
    and, for a LoRA model, ``out/adapter`` in PEFT format (``PeftModel.from_pretrained(base, out/adapter)``).
    ``full_sd`` has the keys of the (PEFT) module's own ``state_dict``."""
    if not is_lora(model):
        model.save_pretrained(out, state_dict=full_sd, safe_serialization=True)
        return
    model = peft_model(model)
    model.get_base_model().save_pretrained(out, state_dict=merged_state_dict(model, full_sd), safe_serialization=True)
    model.save_pretrained(out / ADAPTER_DIR, state_dict=full_sd, safe_serialization=True)
