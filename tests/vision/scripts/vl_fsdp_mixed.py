"""Run under torchrun --nproc_per_node 2 (gloo, CPU): a FSDP2-sharded tiny Qwen2-VL where rank 0's
batch has images and rank 1's is text only. Forward and backward must not hang, and the sharded
logprobs must equal the unsharded model's. Then a sharded LoRA actor: its merged weights
(``full_weights``) equal the unsharded merge, and a step changes only adapters.
Writes $TIDAL_TEST_OUT/rank<R>.json."""

import faulthandler
import json
import os

import torch

faulthandler.dump_traceback_later(float(os.environ.get("TIDAL_TEST_HANG_S", "120")), exit=True)
torch.set_num_threads(1)

from tidal.data import DataConfig, DataSource, PromptDataset  # noqa: E402
from tidal.distributed import init_runtime  # noqa: E402
from tidal.models import load_causal_lm, load_tokenizer  # noqa: E402
from tidal.models.config import LoraConfig  # noqa: E402
from tidal.models.logprobs import token_logprobs  # noqa: E402
from tidal.models.lora import apply_lora, hf_weights  # noqa: E402
from tidal.models.vision import collate_mm_inputs  # noqa: E402
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy  # noqa: E402


def main():
    rt = init_runtime(tp_size=1)
    model_path, eval_path = os.environ["TIDAL_VL_MODEL"], os.environ["TIDAL_VL_EVAL"]
    proc = load_tokenizer(model_path)
    ds = PromptDataset([DataSource(path=eval_path)], proc, DataConfig(shuffle=False), seed=0)
    if rt.rank == 0:
        rows, mm_rows = [ds[0].prompt_ids + [23, 2], ds[1].prompt_ids + [24, 2]], [ds[0].mm_inputs, ds[1].mm_inputs]
    else:
        rows, mm_rows = [proc.tokenizer("only text on this rank", add_special_tokens=False)["input_ids"]], [None]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), proc.pad_token_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : len(r)], am[b, : len(r)] = torch.tensor(r), 1
    mm = collate_mm_inputs(mm_rows)
    plain = load_causal_lm(model_path)
    with torch.no_grad():
        want, _ = token_logprobs(plain, ids, am, mm_inputs=mm)
    strategy = get_strategy(StrategyConfig(param_dtype="float32"), rt)
    state = strategy.prepare_trainable(load_causal_lm(model_path), OptimConfig(lr=1e-3), lr=1e-3, total_steps=1)
    with torch.no_grad():
        got, _ = token_logprobs(state.model, ids, am, mm_inputs=mm)
    logp, _ = token_logprobs(state.model, ids, am, mm_inputs=mm)
    strategy.backward(-(logp * am).sum() / am.sum(), state, sync_grads=True)
    step = strategy.optimizer_step(state)
    res = {"rank": rt.rank, "max_diff": float(((got - want) * am).abs().max()), "grad_norm": step["grad_norm"], "skipped": step["skipped"]}
    res.update(lora_checks(strategy, model_path, ids, am, mm))
    with open(os.path.join(os.environ["TIDAL_TEST_OUT"], f"rank{rt.rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


def lora_actor(model_path):
    actor = apply_lora(load_causal_lm(model_path), LoraConfig(rank=4, alpha=8), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return actor


def lora_checks(strategy, model_path, ids, am, mm):
    want = dict(hf_weights(lora_actor(model_path), lambda p: p.detach()))
    state = strategy.prepare_trainable(lora_actor(model_path), OptimConfig(lr=1e-2), lr=1e-2, total_steps=1)
    got = dict(strategy.full_weights(state.model, torch.float32))
    same_names = sorted(got) == sorted(want)
    diff = max(float((got[n] - want[n]).abs().max()) for n in want) if same_names else float("inf")
    before = {n: p.detach().full_tensor().clone() for n, p in state.model.named_parameters()}
    logp, _ = token_logprobs(state.model, ids, am, mm_inputs=mm)
    strategy.backward(-(logp * am).sum() / am.sum(), state, sync_grads=True)
    strategy.optimizer_step(state)
    changed = [n for n, p in state.model.named_parameters() if not torch.equal(p.detach().full_tensor(), before[n])]
    return {"lora_same_names": same_names, "lora_merge_diff": diff, "lora_changed_only_adapters": bool(changed) and all(".lora_" in n for n in changed)}


if __name__ == "__main__":
    main()
