"""A simple reference engine: a sampling loop over a Hugging Face causal LM with its KV cache.

Correct but not fast (no paging, no continuous batching); used as a baseline and where the native
engine does not support a model, such as vision-language models (Qwen2-VL style: prompts with
images, see :mod:`tidal.models.vision`). Single-rank only: tensor parallelism needs ``engine.backend=native``.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
from transformers import PretrainedConfig

from tidal.engine.base import Completion, SamplingParams, eos_ids, sequence_key
from tidal.engine.config import EngineConfig
from tidal.engine.sampler import keyed_uniforms, sample
from tidal.models.vision import auto_model_class, collate_mm_inputs, multimodal_body_inputs


class HFEngine:
    def __init__(self, hf_config: PretrainedConfig, cfg: EngineConfig, *, device: torch.device, dtype: torch.dtype, tp_group=None):
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.model = auto_model_class(hf_config).from_config(hf_config, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)
        self._params = dict(self.model.named_parameters())
        self.weights_on_cpu = False

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in self._params:
                    raise KeyError(f"HFEngine.load_weights: unknown weight {name!r}")
                self._params[name].copy_(t)

    @torch.no_grad()
    def verify_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """The names whose values differ from the given tensors (empty: this engine holds them)."""
        named = list(named_tensors)
        if not named:
            return []
        flags = torch.stack([(self._params[n] != t.to(self._params[n].device, self._params[n].dtype)).any() for n, t in named]).tolist()
        return sorted(n for (n, _), bad in zip(named, flags) if bad)

    def sleep(self, level: int = 1) -> int:
        if level >= 2 and not self.weights_on_cpu:
            freed = self._weight_bytes() if self.device.type != "cpu" else 0
            self.model.to("cpu")
            self.weights_on_cpu = True
            return freed
        return 0

    def wake_up(self) -> int:
        if self.weights_on_cpu:
            self.model.to(self.device)
            self.weights_on_cpu = False
            return self._weight_bytes() if self.device.type != "cpu" else 0
        return 0

    def memory_report(self) -> dict[str, int]:
        return {"weights": 0 if self.weights_on_cpu or self.device.type == "cpu" else self._weight_bytes(), "kv_cache": 0}

    def _weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, mm_inputs: list[dict | None] | None = None) -> list[Completion]:
        """``mm_inputs[i]``: the pixel inputs of prompt i's images (None for a text prompt), see
        :mod:`tidal.models.vision`; the prompt's ids already hold the image tokens."""
        if self.weights_on_cpu:
            raise RuntimeError("HFEngine.generate called while asleep at level 2: call wake_up() first")
        if mm_inputs is not None and len(mm_inputs) != len(prompts):
            raise ValueError(f"HFEngine.generate: {len(mm_inputs)} mm_inputs for {len(prompts)} prompts")
        expanded = [p for p in prompts for _ in range(params.n)]
        mm_expanded = [m for m in (mm_inputs or [None] * len(prompts)) for _ in range(params.n)]
        out: list[Completion] = []
        step = max(1, len(expanded)) if self.cfg.max_num_seqs == "auto" else self.cfg.max_num_seqs
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        for s in range(0, len(expanded), step):
            out.extend(self._generate_batch(expanded[s : s + step], params, (seed, s), mm_expanded[s : s + step]))
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, stream: tuple[int, int],
                        mm_rows: list) -> list[Completion]:
        """``stream``: (seed, the first row's index in the call): row b (sample ``(first + b) % n``
        of prompt ``(first + b) // n``) draws its token at index i with the keyed uniform of (seed,
        its :func:`~tidal.engine.base.sequence_key`, i), as the native engine's ``generate`` does."""
        B = len(prompts)
        L = max(len(p) for p in prompts)
        pad = 0
        ids_BL = torch.full((B, L), pad, dtype=torch.long, device=self.device)
        mask_BL = torch.zeros((B, L), dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):  # left padding keeps the last prompt token at the end
            ids_BL[b, L - len(p):] = torch.tensor(p, device=self.device)
            mask_BL[b, L - len(p):] = 1
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids(self.model.config))
        tokens = [[] for _ in range(B)]
        logps = [[] for _ in range(B)]
        done = [False] * B
        reasons = ["length"] * B
        mm = collate_mm_inputs(mm_rows, self.device)
        if mm:  # M-RoPE positions [3, B, L]; decode positions continue from each row's largest
            inputs = multimodal_body_inputs(self.model, ids_BL, mask_BL, mm)
        else:
            inputs = dict(input_ids=ids_BL, attention_mask=mask_BL, position_ids=(mask_BL.cumsum(-1) - 1).clamp_min(0))
        pos = inputs["position_ids"]
        out = self.model(**inputs, use_cache=True)
        cache_key = "cache" if "cache" in out else "past_key_values"  # transformers 5 renamed it (the old name warns)
        past, logits_BV = out[cache_key], out.logits[:, -1]
        next_pos_B = pos.reshape(-1, B, L).amax(0)[:, -1] + 1
        seed, first = stream
        n = params.n
        keys_B = np.array([sequence_key((first + b) // n, (first + b) % n) for b in range(B)], dtype=np.uint64)
        index_B = np.array([len(p) for p in prompts])
        for t in range(params.max_new_tokens):
            u_B = None
            if params.temperature > 0:
                u_B = torch.from_numpy(keyed_uniforms(np.full(B, seed & (2**64 - 1), dtype=np.uint64), keys_B,
                                                      index_B + t)).to(self.device)
            tok_B, logp_B = sample(logits_BV, params.temperature, params.top_k, params.top_p, u_B, min_p=params.min_p)
            for b in range(B):
                if done[b]:
                    continue
                t = int(tok_B[b])
                tokens[b].append(t)
                logps[b].append(float(logp_B[b]))
                if t in eos:
                    done[b], reasons[b] = True, "stop"
            if all(done):
                break
            mask_BL = torch.cat([mask_BL, torch.ones((B, 1), dtype=mask_BL.dtype, device=self.device)], dim=1)
            out = self.model(input_ids=tok_B[:, None], attention_mask=mask_BL, position_ids=next_pos_B[:, None], use_cache=True,
                             **{cache_key: past})
            past, logits_BV = out[cache_key], out.logits[:, -1]
            next_pos_B = next_pos_B + 1
        return [
            Completion(prompt_ids=list(p), token_ids=tokens[b], logprobs=logps[b], finish_reason=reasons[b])
            for b, p in enumerate(prompts)
        ]
