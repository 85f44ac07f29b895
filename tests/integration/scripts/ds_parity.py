"""Run under torchrun (gloo, CPU, 1 or 2 ranks): FSDP2 vs DeepSpeed ZeRO-{1,2,3} from one seed.

Each backend trains the same tiny Qwen2 for a few optimizer steps of several micro-batches (loss
shares normalised by the global token count, rank-dependent data, weight decay, warmup + cosine LR,
clipping active), then: offload/reload of actor parameters and optimizer state followed by one more
step, a frozen reference model's logprobs before and after offload/reload, and HF export. Writes
$TIDAL_TEST_OUT/rank<R>.json with losses, grad norms, parameter differences and check results.
"""

import copy
import faulthandler
import json
import math
import os

import torch

faulthandler.dump_traceback_later(float(os.environ.get("TIDAL_TEST_HANG_S", "300")), exit=True)
torch.set_num_threads(1)

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tidal.distributed import init_runtime  # noqa: E402
from tidal.models.logprobs import attach_logprob_method, token_logprobs  # noqa: E402
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy  # noqa: E402

STEPS, MICRO, VOCAB = 3, 3, 96
OPTIM = OptimConfig(lr=2e-2, weight_decay=0.1, warmup_steps=1, scheduler="cosine", min_lr_ratio=0.1, max_grad_norm=0.5)


def tiny_config(tied: bool) -> Qwen2Config:
    return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def batches(rank: int, step: int):
    """MICRO micro-batches of (ids, mask) for this rank and step; ragged lengths, left-aligned."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for m in range(MICRO):
        B, T = 2, 6 + m + rank
        ids = torch.randint(1, VOCAB, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, T - 2 - m :] = 0
        out.append((ids, mask))
    return out


def offload_reload_unchanged(strategy, state, weights) -> bool:
    """Offload and reload the parameters and optimizer state: the full weights are unchanged."""
    strategy.offload_model(state.model)
    strategy.offload_optimizer(state)
    strategy.reload_model(state.model)
    strategy.reload_optimizer(state)
    return max_diff(full(strategy, state.model), weights) == 0.0


def train(strategy, state, rt, steps, first_step=0):
    """Returns per-step (global loss, step metrics). Loss share = -sum(logp * mask) / global tokens."""
    log = []
    for step in range(first_step, first_step + steps):
        mbs = batches(rt.rank, step)
        n_tok = sum(float(m[:, 1:].sum()) for _, m in mbs)
        total = strategy.runtime.all_reduce_sum([n_tok])[0]
        loss_sum = 0.0
        for i, (ids, mask) in enumerate(mbs):
            logp, _ = token_logprobs(state.model, ids, mask, chunk_tokens=5)
            share = -(logp[:, 1:] * mask[:, 1:]).sum() / total
            strategy.backward(share, state, sync_grads=i == len(mbs) - 1)
            loss_sum += float(share)
        metrics = strategy.optimizer_step(state)
        log.append((strategy.runtime.all_reduce_sum([loss_sum])[0], metrics))
    return log


def full(strategy, model):
    return {n: t.float().clone() for n, t in strategy.full_weights(model, torch.float32)}


def max_diff(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def ref_logprobs(model, ids, mask):
    with torch.no_grad():
        return token_logprobs(model, ids, mask, chunk_tokens=4)[0]


def run_backend(rt, base_sd, cfg_model, strategy_cfg, res, tag):
    strategy = get_strategy(strategy_cfg, rt)
    model = Qwen2ForCausalLM(cfg_model)
    model.load_state_dict(base_sd)
    attach_logprob_method(model)
    state = strategy.prepare_trainable(model, OPTIM, lr=OPTIM.lr, total_steps=STEPS + 1)
    if tag != "fsdp2":  # a checkpoint destination of a fresh DeepSpeed model must not alter training
        strategy.state_dict(state)
    log = train(strategy, state, rt, STEPS)
    weights = full(strategy, state.model)
    # offload + reload actor parameters and optimizer state, then one more step
    res[f"{tag}_reload_equal"] = offload_reload_unchanged(strategy, state, weights)
    log += train(strategy, state, rt, 1, first_step=STEPS)
    # a non-finite gradient skips the step on every rank (weights unchanged), the LR still advances
    before = full(strategy, state.model)
    ids, mask = batches(rt.rank, 50)[0]
    logp, _ = token_logprobs(state.model, ids, mask)
    strategy.backward(logp.sum() * float("nan"), state, sync_grads=True)
    nan_step = strategy.optimizer_step(state)
    res[f"{tag}_nan_skipped"] = nan_step["skipped"] == 1.0 and not math.isfinite(nan_step["grad_norm"])
    res[f"{tag}_nan_unchanged"] = max_diff(full(strategy, state.model), before) == 0.0
    res[f"{tag}_lr_after_nan"] = state.scheduler.get_last_lr()[0]
    res[f"{tag}_losses"] = [x[0] for x in log]
    res[f"{tag}_grad_norms"] = [x[1]["grad_norm"] for x in log]
    res[f"{tag}_lrs"] = [x[1]["lr"] for x in log]
    res[f"{tag}_skipped"] = [x[1]["skipped"] for x in log]
    # frozen reference: logprobs equal a plain HF copy, before and after offload/reload
    ref_model = Qwen2ForCausalLM(cfg_model)
    ref_model.load_state_dict(base_sd)
    attach_logprob_method(ref_model)
    plain = copy.deepcopy(ref_model)
    ref = strategy.prepare_frozen(ref_model, offload=True)
    ids, mask = batches(rt.rank, 99)[0]
    expect = ref_logprobs(plain, ids, mask)
    strategy.reload_model(ref)
    first = ref_logprobs(ref, ids, mask)
    strategy.offload_model(ref)
    strategy.reload_model(ref)
    second = ref_logprobs(ref, ids, mask)
    strategy.offload_model(ref)
    res[f"{tag}_ref_diff"] = max(float((first - expect).abs().max()), float((second - expect).abs().max()))
    res[f"{tag}_ref_full_equal"] = max_diff(full(strategy, ref), {n: p.float() for n, p in plain.named_parameters()}) == 0.0
    # HF export: rank 0 holds the full fp32 state dict, loadable into a fresh HF model
    sd = strategy.full_model_state_dict(state.model)
    final = full(strategy, state.model)
    if rt.rank == 0:
        fresh = Qwen2ForCausalLM(cfg_model)
        fresh.load_state_dict(sd, strict=True)
        res[f"{tag}_export_equal"] = max_diff({n: p.detach() for n, p in fresh.named_parameters()}, final) == 0.0
    else:
        res[f"{tag}_export_empty"] = sd == {}
    return final


def main():
    rt = init_runtime(tp_size=1, device="cpu")
    linear = torch.nn.functional.linear
    stages = [int(s) for s in os.environ.get("TIDAL_DS_STAGES", "1,2,3").split(",")]
    tied = os.environ.get("TIDAL_DS_TIED", "0") == "1"
    torch.manual_seed(0)
    cfg_model = tiny_config(tied)
    base_sd = copy.deepcopy(Qwen2ForCausalLM(cfg_model).state_dict())
    res = {"rank": rt.rank, "world": rt.world_size, "stages": stages}
    weights = {"fsdp2": run_backend(rt, base_sd, cfg_model, StrategyConfig(), res, "fsdp2")}
    for s in stages:
        weights[f"z{s}"] = run_backend(rt, base_sd, cfg_model, StrategyConfig(backend="deepspeed", zero_stage=s), res, f"z{s}")
        res[f"z{s}_param_diff"] = max_diff(weights[f"z{s}"], weights["fsdp2"])
    res["linear_untouched"] = torch.nn.functional.linear is linear  # ZeRO-3 patches nothing process-wide
    res["moved"] = max_diff(weights["fsdp2"], {k: v.float() for k, v in base_sd.items() if k in weights["fsdp2"]})
    with open(os.path.join(os.environ["TIDAL_TEST_OUT"], f"rank{rt.rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
