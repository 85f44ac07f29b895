"""LoRA through the whole pipeline on the tiny quickstart task: only adapters train (and only they
are in the optimizer), the reference is the base (KL is exactly 0 before the first update), the
engine receives merged HF-named weights, export loads with from_pretrained and
PeftModel.from_pretrained, and a resumed LoRA run logs what an uninterrupted one does. On FSDP2
and on DeepSpeed (ZeRO-1 and ZeRO-3)."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.models.lora import AdapterDisabledReference
from tidal.trainer.export import export_hf

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=2e-2", "rollout.ignore_eos=true",
        "reward.components.correct.path=tests.e2e.rewards:text_hash_reward"]


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keep = ("reward/", "actor/", "response/", "advantage/", "mismatch/", "kl/")
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(keep) and not k.endswith("seconds")} for r in rows}


def _fit(cfg):
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        shutdown()


@pytest.mark.slow
def test_lora_trains_adapters_syncs_merged_and_exports(tmp_path, tiny_task_overrides):
    cfg = load_config("quickstart", tiny_task_overrides + LORA + [
        f"run.output_dir={tmp_path}", "run.steps=2", "checkpoint.at_end=false", "algorithm.kl_coef=0.05",
        "engine.backend=hf", "engine.kv_cache_max_tokens=0",  # a paged-engine setting the tiny overrides give
    ])
    trainer = build_trainer(cfg)
    try:
        model = trainer.models.actor.model
        assert isinstance(trainer.models.reference, AdapterDisabledReference)
        names = {id(p): n for n, p in model.named_parameters()}
        in_optimizer = [names[id(p)] for g in trainer.models.actor.optimizer.param_groups for p in g["params"]]
        assert in_optimizer and all(".lora_A." in n or ".lora_B." in n for n in in_optimizer)
        before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        metrics = trainer.fit()
        assert math.isfinite(metrics["actor/loss"])
        changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach().full_tensor(), before[n])]
        assert changed and all(".lora_" in n for n in changed), changed
        assert any(".lora_B." in n for n in changed)
        logged = _metrics(tmp_path)
        # KL from the update's forward (one optimizer step per rollout: no separate old-logprob pass)
        assert logged[1]["actor/kl"] == 0.0  # before any update the actor is its base: the reference
        assert logged[2]["actor/kl"] > 0.0

        # the engine holds W + (alpha/r) B A under HF names
        engine_params = dict(trainer.colocation.engine.model.named_parameters())
        merged = dict(trainer.colocation.strategy.full_weights(model, torch.float32))
        assert sorted(merged) == sorted(engine_params)
        for n, t in merged.items():
            torch.testing.assert_close(engine_params[n].detach(), t, msg=n)
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(merged[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])

        _check_export(trainer, model, cfg, tmp_path / "export")
    finally:
        shutdown()


def _task_model_path(cfg) -> str:
    from tidal.tasks import prepare

    return prepare(cfg.task).model_path


BACKENDS = {
    "fsdp2": [],
    "deepspeed-z1": ["strategy.backend=deepspeed", "strategy.zero_stage=1", "run.device=cpu"],
    "deepspeed-z3": ["strategy.backend=deepspeed", "strategy.zero_stage=3", "run.device=cpu"],
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_lora_resume_matches_uninterrupted(tmp_path, tiny_task_overrides, monkeypatch, backend):
    if backend != "fsdp2":
        pytest.importorskip("deepspeed")
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    common = tiny_task_overrides + LORA + BACKENDS[backend] + ["checkpoint.every=2", "checkpoint.keep=3"]
    _fit(load_config("quickstart", common + [f"run.output_dir={tmp_path / 'a'}", "run.steps=4"]))
    _fit(load_config("quickstart", common + [f"run.output_dir={tmp_path / 'b'}", "run.steps=2"]))
    ckpt = tmp_path / "b" / "checkpoints" / "step_000002"
    _fit(load_config("quickstart", common + [f"run.output_dir={tmp_path / 'b'}", "run.steps=4"]))
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        for k, v in a[step].items():
            assert v == pytest.approx(b[step][k], rel=1e-6, abs=1e-9), (step, k)
    assert a[4]["actor/grad_norm"] > 0
    # the checkpoint holds the adapters (and their optimizer state), not a copy of the base
    meta = torch.distributed.checkpoint.FileSystemReader(str(ckpt / "models")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("actor.model.")]
    if backend == "deepspeed-z3":  # ZeRO-3 saves the adapters as fp32 masters in the optimizer state only
        assert not model_keys
    else:
        assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:4]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_lora_deepspeed_trains_adapters_syncs_merged_and_exports(tmp_path, tiny_task_overrides, monkeypatch, stage):
    """The same LoRA run on the DeepSpeed backend: reference = base (KL 0 at step 1), only adapters
    change, the engine holds the merged weights, export round-trips (merged and PEFT adapter)."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import safe_get_full_fp32_param

    from tidal.models.lora import peft_model

    cfg = load_config("quickstart", tiny_task_overrides + LORA + [
        f"run.output_dir={tmp_path}", "run.steps=2", "run.device=cpu", "checkpoint.at_end=false",
        "algorithm.kl_coef=0.05", "engine.backend=hf", "engine.kv_cache_max_tokens=0", "strategy.backend=deepspeed", f"strategy.zero_stage={stage}",
    ])
    trainer = build_trainer(cfg)
    try:
        peft = peft_model(trainer.models.actor.model)
        assert isinstance(trainer.models.reference, AdapterDisabledReference)

        def adapters():
            return {n: safe_get_full_fp32_param(p).clone() for n, p in peft.named_parameters() if p.requires_grad}

        before_adapters = adapters()
        before_merged = dict(trainer.colocation.strategy.full_weights(trainer.models.actor.model, torch.float32))
        metrics = trainer.fit()
        assert math.isfinite(metrics["actor/loss"])
        after = adapters()
        assert any(not torch.equal(after[n], before_adapters[n]) for n in after if ".lora_B." in n)
        merged = dict(trainer.colocation.strategy.full_weights(trainer.models.actor.model, torch.float32))
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(merged[q], before_merged[q])
        for n in ("model.embed_tokens.weight", "model.norm.weight"):  # not LoRA targets: frozen
            assert torch.equal(merged[n], before_merged[n]), n
        logged = _metrics(tmp_path)
        assert logged[1]["actor/kl"] == 0.0 and logged[2]["actor/kl"] > 0.0

        engine_params = dict(trainer.colocation.engine.model.named_parameters())
        assert sorted(merged) == sorted(engine_params)
        for n, t in merged.items():
            torch.testing.assert_close(engine_params[n].detach(), t, msg=n)

        _check_export(trainer, trainer.models.actor.model, cfg, tmp_path / "export")
    finally:
        shutdown()


def _check_export(trainer, model, cfg, out):
    """The merged HF export and the PEFT adapter over the base both reproduce ``model``'s token
    logprobs (``model`` runs packed forwards only: it is scored through tidal's logprob method)."""
    from peft import PeftModel

    from tidal.models.logprobs import token_logprobs

    export_hf(trainer, str(out))
    ids = torch.tensor([trainer.data.train[0].prompt_ids])

    def logprobs(hf_model):  # of tokens 1.. given the ones before, [1, T-1]
        logp_1TV = torch.log_softmax(hf_model(input_ids=ids).logits[:, :-1].float(), dim=-1)
        return logp_1TV.gather(-1, ids[:, 1:, None])[..., 0]

    with torch.no_grad():
        want = token_logprobs(model, ids, torch.ones_like(ids))[0][:, 1:]
        got = logprobs(AutoModelForCausalLM.from_pretrained(out))
        base = AutoModelForCausalLM.from_pretrained(_task_model_path(cfg))
        adapter = logprobs(PeftModel.from_pretrained(base, out / "adapter"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(adapter, want, rtol=1e-4, atol=1e-5)
