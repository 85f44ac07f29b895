"""Loading actor, critic, reference and tokenizer from local Hugging Face folders."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

from tidal import families
from tidal.config_base import ConfigError
from tidal.models.logprobs import attach_logprob_method
from tidal.models.varlen import uses_packed_attention
from tidal.models.vision import auto_model_class, is_vision_language


def _require_dir(path: str, what: str) -> None:
    if not path or not os.path.isdir(path):
        raise ValueError(f"{what}: model path {path!r} is not a local directory (Tidal never downloads; pass a local HF folder)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{what}: {path!r} has no config.json; is it a Hugging Face model folder?")


def load_causal_lm(path: str, *, dtype: torch.dtype = torch.float32, what: str = "model.path") -> torch.nn.Module:
    """Load an HF causal LM (or a vision-language model, e.g. Qwen2-VL) on CPU in ``dtype`` with the
    Tidal logprob method attached. A ``ForConditionalGeneration`` checkpoint of a ``text_only``
    family (Gemma 3) loads as its text decoder alone (:func:`_load_text_tower`)."""
    _require_dir(path, what)
    config = AutoConfig.from_pretrained(path)
    family = families.find_family(config)
    if is_vision_language(config) and family is not None and family.text_only:
        model = _load_text_tower(path, config, family.text_prefix, dtype)
    else:
        model = auto_model_class(config).from_pretrained(path, dtype=dtype)
    attach_logprob_method(model)
    return model


def _load_text_tower(path: str, config, prefix: str, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of ``config``'s text config with the checkpoint's text weights, named in
    either layout (:func:`tidal.families.text_tower_name`; the vision tower's and projector's
    weights are not read). Every parameter of the text model must come from the checkpoint (a tied
    LM head excepted)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config.get_text_config(), dtype=dtype)
    state = {}
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, name), "pt", "cpu") as f:
            for key in f.keys():
                text = families.text_tower_name(key, prefix)
                if text is not None:
                    state[text] = f.get_tensor(key).to(dtype)
    missing = model.load_state_dict(stacked_experts(state), strict=False).missing_keys
    if model.config.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise ValueError(f"{path}: the text tower's weights {missing[:4]} are not in the checkpoint (under {prefix!r})")
    return model


def stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with per-expert weights (``...experts.{e}.gate_proj.weight``, the layout MoE
    checkpoints keep on disk; names mapped by :func:`tidal.families.expert_weight`) stacked as
    ``transformers`` 5 holds them, as its own loading converts them: ``experts.gate_up_proj``
    ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``experts.down_proj`` ``[E, H, I]``."""
    parts: dict[str, dict[int | None, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, tensor in state.items():
        w = families.expert_weight(key)
        if w is None:
            out[key] = tensor
        else:
            parts.setdefault(w.stacked, {}).setdefault(w.half, {})[w.expert] = tensor
    for stacked, halves in parts.items():
        ids = sorted(next(iter(halves.values())))
        want = {0, 1} if stacked.endswith("gate_up_proj") else {None}
        if set(halves) != want or any(sorted(h) != ids for h in halves.values()) or ids != list(range(len(ids))):
            raise ValueError(f"{stacked}: the checkpoint's per-expert weights do not cover experts 0..E-1 alike")
        if None in halves:
            out[stacked] = torch.stack([halves[None][e] for e in ids])
        else:
            out[stacked] = torch.stack([torch.cat([halves[0][e], halves[1][e]], 0) for e in ids])
    return out


def load_critic(path: str, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load a value model: the LM body with a scalar head per token (``score``), freshly initialised
    (zeros) when the checkpoint is a plain causal LM. No dropout before the head (transformers'
    token-classification default is 0.1, which would make the values of one sequence differ between
    the experience pass and the update, and noisy within it)."""
    _require_dir(path, "model.critic_path")
    cfg = AutoConfig.from_pretrained(path)
    if is_vision_language(cfg):
        raise ValueError("estimators with a critic (gae) do not support vision-language models yet; use a critic-free one (grpo, rloo, ...)")
    head_cfg = AutoConfig.from_pretrained(path, num_labels=1)
    setattr(head_cfg, "classifier_dropout", 0.0)  # read by the token-classification head's constructor
    model = AutoModelForTokenClassification.from_pretrained(path, config=head_cfg, dtype=dtype)
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is not None and "TokenClassification" not in "".join(cfg.architectures or []):
        torch.nn.init.zeros_(head.weight)
        if head.bias is not None:
            torch.nn.init.zeros_(head.bias)
    return model


def model_positions(hf_config) -> int | None:
    """How many positions the model has (``max_position_embeddings`` of its text config, which a
    vision-language config keeps apart), or None when its config does not say."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    n = getattr(text, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def check_context_fits(hf_config, *, max_prompt_len: int, max_new_tokens: int) -> None:
    """At setup, not mid-training: a prompt of up to ``data.max_prompt_len`` tokens plus
    ``rollout.max_new_tokens`` generated ones must fit the model's positions (positions past them
    are an index error or silent garbage, depending on the kernel). ConfigError naming the key to
    change; nothing is checked when the config gives no ``max_position_embeddings``."""
    positions = model_positions(hf_config)
    if positions is None:
        return
    if max_prompt_len >= positions:
        raise ConfigError("data.max_prompt_len", f"{max_prompt_len} leaves no room to generate: the model has {positions} "
                          "positions (max_position_embeddings); lower it")
    if max_prompt_len + max_new_tokens > positions:
        raise ConfigError("rollout.max_new_tokens", f"data.max_prompt_len ({max_prompt_len}) + rollout.max_new_tokens "
                          f"({max_new_tokens}) = {max_prompt_len + max_new_tokens} exceeds the model's {positions} positions "
                          f"(max_position_embeddings); lower one of them")


def check_tokenizer_fits(tokenizer, hf_config, *, key: str = "model.tokenizer_path") -> None:
    """Every id the tokenizer can produce has a row in the model's embedding (``vocab_size`` of its
    text config); else ConfigError at ``key`` naming the tokens without one. The usual cause: a
    tokenizer_config.json without pad/eos tokens, for which the tokenizer class invents its default
    (Qwen2's ``<|endoftext|>``) as a new token past the model's vocabulary -- an IndexError in the
    first forward pass otherwise."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    rows = getattr(text, "vocab_size", None)
    if not isinstance(rows, int) or len(tokenizer) <= rows:
        return
    extra = sorted((i, t) for t, i in tokenizer.get_added_vocab().items() if i >= rows)
    names = ", ".join(f"{t!r} (id {i})" for i, t in extra[:5]) or f"ids {rows}..{len(tokenizer) - 1}"
    raise ConfigError(key, f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows: {names} "
                      "have none (a special token the tokenizer class invented because tokenizer_config.json names no "
                      "pad/eos token?); name tokens of the model's vocabulary there")


def load_tokenizer(path: str):
    """The tokenizer of a model folder; for a folder with an image processor (``preprocessor_config.json``,
    a vision-language model) a :class:`~tidal.data.vision.VisionProcessor` that behaves as the tokenizer
    for text and also turns images into image tokens and pixel inputs.

    Padding: a tokenizer without a pad token pads with its EOS token (pad positions are masked out);
    one with neither is a ConfigError at ``model.tokenizer_path``. In a model folder every token id
    must have an embedding row (:func:`check_tokenizer_fits`)."""
    from tidal.data.vision import VisionProcessor, load_image_processor

    _require_dir(path, "model.tokenizer_path")
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:  # padding is masked out everywhere: any real token will do, EOS by convention
        if tok.eos_token_id is None:
            raise ConfigError("model.tokenizer_path", f"the tokenizer in {path} has neither a pad token nor an EOS token; "
                              "set pad_token (and eos_token) in its tokenizer_config.json to tokens of its vocabulary")
        tok.pad_token = tok.eos_token
    if _is_model_folder(path):  # its ids must all have embedding rows
        check_tokenizer_fits(tok, AutoConfig.from_pretrained(path))
    image_processor = load_image_processor(path)
    return VisionProcessor(tok, image_processor) if image_processor is not None else tok


def _is_model_folder(path: str) -> bool:
    """A folder with a model's config.json (one naming a ``model_type``); a tokenizer-only folder may
    hold a config.json that names just its tokenizer class."""
    import json

    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        return False
    try:
        with open(config) as f:
            return "model_type" in json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError("model.tokenizer_path", f"{config} is not readable JSON: {e}") from e


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's token -> id map and its special-token ids: equal fingerprints mean the
    two tokenizers give every token the same id (what on-policy distillation needs of a teacher)."""
    import hashlib
    import json

    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a multimodal processor's text tokenizer
    special = {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    blob = json.dumps([sorted(tok.get_vocab().items()), special], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def check_same_tokenizer(student, teacher_fingerprint: str, *, key: str, teacher_vocab: int | None = None) -> None:
    """ConfigError at ``key`` when the teacher's tokenizer is not the student's."""
    if tokenizer_fingerprint(student) == teacher_fingerprint:
        return
    sizes = f" (vocab sizes {len(getattr(student, 'tokenizer', student).get_vocab())} vs {teacher_vocab})" if teacher_vocab else ""
    raise ConfigError(
        key, f"the teacher's tokenizer differs from the student's{sizes}: distillation scores the student's token "
        "ids with the teacher, so both must use one tokenizer (same vocabulary, ids and special tokens)",
    )


def critic_values(critic: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, packed=None) -> torch.Tensor:
    """values_BT[b, t] = V(input_ids[b, :t]): the value of the state in which token t is chosen, aligned
    like logprobs (the critic's output at position t-1); position 0 is 0. fp32.

    ``packed``: the :class:`~tidal.models.packing.PackedBatch` of these rows (on the critic's device,
    the critic switched with :func:`~tidal.models.varlen.enable_packed_attention`): the forward runs
    padding-free and the values are non-zero only at the packed batch's targets. A critic switched
    to packed attention packs a call without ``packed`` itself (every real token a target)."""
    if packed is None and uses_packed_attention(critic):
        from tidal.models.packing import pack_on_the_fly

        packed = pack_on_the_fly(input_ids_BT, attention_mask_BT, None)
    if packed is not None:
        from tidal.models.packing import packed_critic_values

        return packed_critic_values(critic, packed)
    position_ids_BT = (attention_mask_BT.long().cumsum(-1) - 1).clamp_min(0)
    out = critic(input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=position_ids_BT, use_cache=False)
    v_BT = out.logits[..., 0].float()
    return torch.cat([torch.zeros_like(v_BT[:, :1]), v_BT[:, :-1]], dim=1)
