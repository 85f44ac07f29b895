"""Run under torchrun (gloo, CPU, 1 or 2 ranks): a LoRA (PEFT) actor on FSDP2 vs DeepSpeed ZeRO-{1,2,3}.

Each backend wraps the same tiny Qwen2 in the same adapters (one seed), trains a few optimizer
steps of several micro-batches (clipping active) and then checks, per backend: the optimizer holds
only the adapters, the base weights did not move, offload/reload of actor parameters and optimizer
state changes nothing, the adapter-disabled reference gives the base model's logprobs before and
after offload/reload, ``update_engine_weights`` leaves an HF engine holding PEFT's own merge of the
actor (``merge_and_unload``), and export writes merged HF weights and a PEFT adapter folder that
reproduce the actor's logits. Gathers run in small buckets so that ZeRO-3 merges bucket by bucket.
Writes $TIDAL_TEST_OUT/rank<R>.json.
"""

import copy
import faulthandler
import json
import os
import tempfile
from pathlib import Path

import torch

faulthandler.dump_traceback_later(float(os.environ.get("TIDAL_TEST_HANG_S", "300")), exit=True)
torch.set_num_threads(1)

from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: E402

import tidal.strategy.deepspeed as ds_strategy  # noqa: E402
from tidal.distributed import init_runtime  # noqa: E402
from tidal.engine.config import EngineConfig  # noqa: E402
from tidal.engine.hf import HFEngine  # noqa: E402
from tidal.models.config import LoraConfig  # noqa: E402
from tidal.models.logprobs import attach_logprob_method, token_logprobs  # noqa: E402
from tidal.models.lora import adapter_disabled_reference, apply_lora, peft_model, save_hf  # noqa: E402
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy  # noqa: E402
from tidal.sync import update_engine_weights  # noqa: E402

from ds_parity import batches, full, max_diff, offload_reload_unchanged, tiny_config, train  # noqa: E402

STEPS = 3
LORA = LoraConfig(rank=4, alpha=8.0)
OPTIM = OptimConfig(lr=2e-2, weight_decay=0.1, warmup_steps=1, scheduler="cosine", min_lr_ratio=0.1, max_grad_norm=0.2)
ds_strategy.GATHER_BUCKET_BYTES = 16 << 10  # a few layers' weights per ZeRO-3 gather


def lora_model(cfg_model, base_sd, *, gc: bool):
    model = Qwen2ForCausalLM(cfg_model)
    model.load_state_dict(base_sd)
    if gc:
        model.gradient_checkpointing_enable()
    return apply_lora(model, LORA, seed=7)


def adapters(strategy, state) -> dict[str, torch.Tensor]:
    """Full fp32 values of the adapter parameters (a collective)."""
    module = peft_model(state.model)
    out = {}
    for n, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "full_tensor"):
            out[n] = p.full_tensor().detach().clone()
        else:
            out[n] = ds_strategy.safe_get_full_fp32_param(p).detach().clone()
    return out


def optimizer_holds_adapters_only(state) -> bool:
    names = {id(p): n for n, p in peft_model(state.model).named_parameters()}
    zero = state.optimizer
    if hasattr(zero, "fp16_groups"):  # ZeRO-3
        groups = zero.fp16_groups
    elif hasattr(zero, "bit16_groups"):  # ZeRO-1/2
        groups = zero.bit16_groups
    else:
        groups = [g["params"] for g in zero.param_groups]
    held = sorted(names[id(p)] for g in groups for p in g)
    want = sorted(n for n, p in peft_model(state.model).named_parameters() if p.requires_grad)
    return held == want and all(".lora_A." in n or ".lora_B." in n for n in held)


def logprobs(model, ids, mask):
    with torch.no_grad():
        return token_logprobs(model, ids, mask, chunk_tokens=4)[0]


def check_reference(strategy, state, plain_base, res, tag):
    ref = adapter_disabled_reference(state.model)
    ids, mask = batches(0, 99)[0]  # the same on every rank
    expect = logprobs(plain_base, ids, mask)
    strategy.offload_model(ref)  # a no-op: it owns nothing
    strategy.reload_model(ref)
    first = logprobs(ref, ids, mask)
    strategy.offload_model(ref)
    strategy.reload_model(ref)
    second = logprobs(ref, ids, mask)
    actor = logprobs(state.model, ids, mask)
    res[f"{tag}_ref_diff"] = max(float((first - expect).abs().max()), float((second - expect).abs().max()))
    res[f"{tag}_actor_vs_base"] = float((actor - expect).abs().max())


def check_engine_and_export(strategy, state, cfg_model, base_sd, res, tag):
    engine = HFEngine(cfg_model, EngineConfig(backend="hf"), device=strategy.device, dtype=torch.float32)
    sent = update_engine_weights(strategy, state.model, engine, dtype=torch.float32, bucket_bytes=8 << 10)
    res[f"{tag}_engine_bytes"] = sent
    engine_w = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    sd = strategy.full_model_state_dict(state.model)
    if strategy.runtime.rank != 0:
        res[f"{tag}_export_empty"] = sd == {}
        return
    # PEFT's own merge of the exported actor state: what the engine must hold
    peft = lora_model(cfg_model, base_sd, gc=False)
    peft.load_state_dict(sd, strict=True)
    want = {n: p.detach() for n, p in copy.deepcopy(peft).merge_and_unload().named_parameters()}
    res[f"{tag}_engine_vs_peft_merge"] = max_diff(engine_w, want)
    base_now = {base_key(k): v for k, v in sd.items() if ".lora_" not in k}
    res[f"{tag}_base_unchanged"] = max_diff(base_now, {k: base_sd[k] for k in base_now}) == 0.0
    with tempfile.TemporaryDirectory() as d:
        save_hf(state.model, sd, Path(d))
        ids, mask = batches(0, 77)[0]
        with torch.no_grad():
            logits = peft(input_ids=ids, attention_mask=mask).logits
            merged = AutoModelForCausalLM.from_pretrained(d)(input_ids=ids, attention_mask=mask).logits
            from peft import PeftModel

            fresh = Qwen2ForCausalLM(cfg_model)
            fresh.load_state_dict(base_sd)
            adapter = PeftModel.from_pretrained(fresh, os.path.join(d, "adapter"))(input_ids=ids, attention_mask=mask).logits
        res[f"{tag}_export_merged_diff"] = float((merged - logits).abs().max())
        res[f"{tag}_export_adapter_diff"] = float((adapter - logits).abs().max())


def base_key(peft_key: str) -> str:
    return peft_key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def run_backend(rt, base_sd, cfg_model, strategy_cfg, res, tag, *, gc: bool):
    strategy = get_strategy(strategy_cfg, rt)
    model = lora_model(cfg_model, base_sd, gc=gc)
    plain_base = Qwen2ForCausalLM(cfg_model)
    plain_base.load_state_dict(base_sd)
    attach_logprob_method(plain_base)
    state = strategy.prepare_trainable(model, OPTIM, lr=OPTIM.lr, total_steps=STEPS + 1)
    res[f"{tag}_optimizer_adapters_only"] = optimizer_holds_adapters_only(state)
    if tag == "z3":  # ZeRO-3 partitions the frozen base too: each rank holds 1/world of every weight
        frozen = [p for p in peft_model(state.model).parameters() if not p.requires_grad]
        res["z3_base_partitioned"] = bool(frozen) and all(
            p.ds_tensor.numel() == -(-p.ds_numel // rt.world_size) for p in frozen
        )
    log = train(strategy, state, rt, STEPS)
    weights = full(strategy, state.model)
    res[f"{tag}_reload_equal"] = offload_reload_unchanged(strategy, state, weights)
    log += train(strategy, state, rt, 1, first_step=STEPS)
    res[f"{tag}_losses"] = [x[0] for x in log]
    res[f"{tag}_grad_norms"] = [x[1]["grad_norm"] for x in log]
    res[f"{tag}_lrs"] = [x[1]["lr"] for x in log]
    res[f"{tag}_skipped"] = [x[1]["skipped"] for x in log]
    check_reference(strategy, state, plain_base, res, tag)
    check_engine_and_export(strategy, state, cfg_model, base_sd, res, tag)
    return full(strategy, state.model), adapters(strategy, state)


def main():
    rt = init_runtime(tp_size=1, device="cpu")
    stages = [int(s) for s in os.environ.get("TIDAL_DS_STAGES", "1,2,3").split(",")]
    tied = os.environ.get("TIDAL_DS_TIED", "0") == "1"
    gc = os.environ.get("TIDAL_DS_GC", "0") == "1"
    dtype = os.environ.get("TIDAL_DS_DTYPE", "auto")  # param_dtype of both backends
    torch.manual_seed(0)
    cfg_model = tiny_config(tied)
    base_sd = copy.deepcopy(Qwen2ForCausalLM(cfg_model).state_dict())
    res = {"rank": rt.rank, "world": rt.world_size, "stages": stages}
    merged_w, adapter_w = {}, {}
    merged_w["fsdp2"], adapter_w["fsdp2"] = run_backend(rt, base_sd, cfg_model, StrategyConfig(param_dtype=dtype), res, "fsdp2", gc=gc)
    for s in stages:
        t = f"z{s}"
        cfg = StrategyConfig(backend="deepspeed", zero_stage=s, param_dtype=dtype)
        merged_w[t], adapter_w[t] = run_backend(rt, base_sd, cfg_model, cfg, res, t, gc=gc)
        res[f"{t}_merged_diff"] = max_diff(merged_w[t], merged_w["fsdp2"])
        res[f"{t}_adapter_diff"] = max_diff(adapter_w[t], adapter_w["fsdp2"])
    res["adapters_moved"] = max(float(v.abs().max()) for k, v in adapter_w["fsdp2"].items() if ".lora_B." in k)
    res["merged_moved"] = max_diff(merged_w["fsdp2"], {k: v for k, v in base_sd.items() if k in merged_w["fsdp2"]})
    with open(os.path.join(os.environ["TIDAL_TEST_OUT"], f"rank{rt.rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
