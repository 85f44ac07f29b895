"""Run under torchrun (gloo, CPU): DeepSpeed ZeRO-{1,2,3} checkpoint -> exact resume, through
Tidal's atomic DCP checkpoint (tidal.run.checkpoint). For each stage: train two steps, save,
train a third step (the reference); then a fresh strategy and a differently initialised model load
the checkpoint and train the same third step. With TIDAL_DS_LORA=1 the actor is a LoRA (PEFT)
model: the fresh one has the same base and differently initialised adapters, and the checkpoint must
hold the adapters and their optimizer state only. Writes $TIDAL_TEST_OUT/rank<R>.json.
"""

import faulthandler
import json
import os
from pathlib import Path

import torch

faulthandler.dump_traceback_later(float(os.environ.get("TIDAL_TEST_HANG_S", "300")), exit=True)
torch.set_num_threads(1)

from transformers import Qwen2ForCausalLM  # noqa: E402

from tidal.distributed import init_runtime  # noqa: E402
from tidal.models.logprobs import attach_logprob_method  # noqa: E402
from tidal.strategy import StrategyConfig, get_strategy  # noqa: E402
from tidal.run import checkpoint as ckpt  # noqa: E402

from ds_parity import OPTIM, full as merged_weights, max_diff, tiny_config, train  # noqa: E402

LORA = os.environ.get("TIDAL_DS_LORA", "0") == "1"


def fresh_state(rt, stage, seed):
    if LORA:  # the base is re-read from model.path on resume: only the adapters start differently
        from ds_lora_parity import LORA as LORA_CFG
        from tidal.models.lora import apply_lora

        torch.manual_seed(0)
        model = apply_lora(Qwen2ForCausalLM(tiny_config(tied=False)), LORA_CFG, seed=seed)
    else:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(tiny_config(tied=False))
        attach_logprob_method(model)
    strategy = get_strategy(StrategyConfig(backend="deepspeed", zero_stage=stage), rt)
    return strategy, strategy.prepare_trainable(model, OPTIM, lr=OPTIM.lr, total_steps=4)


def weights(strategy, state):
    """Merged HF weights, and for LoRA the adapters themselves (a fresh adapter B is 0: the merge
    alone would not tell two fresh LoRA models apart)."""
    out = merged_weights(strategy, state.model)
    if LORA:
        from ds_lora_parity import adapters

        out.update(adapters(strategy, state))
    return out


def checkpoint_model_keys(path: Path) -> list[str]:
    meta = torch.distributed.checkpoint.FileSystemReader(str(path / "models")).read_metadata()
    return [k for k in meta.state_dict_metadata if k.startswith("actor.model.")]


def check_stage(rt, stage, root: Path, res):
    tag = f"z{stage}"
    strategy, state = fresh_state(rt, stage, seed=0)
    train(strategy, state, rt, 2)
    saved = weights(strategy, state)
    path = ckpt.save_checkpoint(root / tag, 2, model_states={"actor": strategy.state_dict(state)},
                                trainer_state={"step": 2}, runtime=rt, keep=1)
    # the reference continuation: step index 2 of the schedule on step-2 data
    ref_log = train(strategy, state, rt, 1, first_step=2)
    ref_weights = weights(strategy, state)

    if LORA:
        keys = checkpoint_model_keys(path)
        # ZeRO-1/2 save the trained compute-dtype weights (the adapters); ZeRO-3 only the fp32 masters
        res[f"{tag}_model_keys_adapters_only"] = (bool(keys) if stage < 3 else not keys) and all(".lora_" in k for k in keys)
    strategy2, state2 = fresh_state(rt, stage, seed=123)
    res[f"{tag}_fresh_differs"] = max_diff(weights(strategy2, state2), saved) > 0
    states = {"actor": strategy2.state_dict(state2)}
    st = ckpt.load_checkpoint(path, model_states=states, rank=rt.rank)
    strategy2.load_state_dict(state2, states["actor"])
    res[f"{tag}_trainer_step"] = st["step"]
    res[f"{tag}_loaded_diff"] = max_diff(weights(strategy2, state2), saved)
    log = train(strategy2, state2, rt, 1, first_step=2)
    res[f"{tag}_resume_loss_equal"] = log[0][0] == ref_log[0][0]
    res[f"{tag}_resume_metrics"] = [log[0][1], ref_log[0][1]]
    res[f"{tag}_resume_diff"] = max_diff(weights(strategy2, state2), ref_weights)
    try:
        strategy2.load_state_dict(state2, {**states["actor"], "optimizer": {"rank9_of10": {}}})
        res[f"{tag}_wrong_world_rejected"] = False
    except ValueError:
        res[f"{tag}_wrong_world_rejected"] = True


def main():
    rt = init_runtime(tp_size=1, device="cpu")
    stages = [int(s) for s in os.environ.get("TIDAL_DS_STAGES", "1,2,3").split(",")]
    out = Path(os.environ["TIDAL_TEST_OUT"])
    res = {"rank": rt.rank, "stages": stages}
    for s in stages:
        check_stage(rt, s, out / "ckpt", res)
    with open(out / f"rank{rt.rank}.json", "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
