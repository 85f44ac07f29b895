"""Run under torchrun --nproc_per_node 2 (gloo, CPU). Checks FSDP2 + rollout TP groups + weight sync.

Writes one JSON line per rank to $TIDAL_TEST_OUT/rank<R>.json with the checks' results.
"""

import faulthandler
import json
import os

import torch

faulthandler.dump_traceback_later(float(os.environ.get("TIDAL_TEST_HANG_S", "240")), exit=True)

torch.set_num_threads(1)

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tidal.distributed import gather_and_generate, init_runtime  # noqa: E402
from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.engine.config import EngineConfig  # noqa: E402
from tidal.engine.hf import HFEngine  # noqa: E402
from tidal.engine.native import NativeEngine  # noqa: E402
from tidal.models.logprobs import attach_logprob_method, token_logprobs  # noqa: E402
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy  # noqa: E402
from tidal.sync import update_engine_weights  # noqa: E402


def hf_greedy(model, prompts, n_new):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def bucketed_gather_checks(model, rt):
    """BucketedFullTensors equals DTensor.full_tensor() (in and out of order, uneven dim-0 shards)
    with fewer collectives than parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tidal.strategy.gather import BucketedFullTensors

    params = dict(model.named_parameters())
    names = list(params)
    gather = BucketedFullTensors(model, rt.device, bucket_bytes=32 << 10)
    order = names[-3:][::-1] + names  # a few out of order first, then all (the first three again)
    equal = all(torch.equal(gather(params[n]), params[n].full_tensor()) for n in order)
    torch.manual_seed(1)
    odd = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Embedding(9, 5))
    fully_shard(odd, mesh=init_device_mesh("cpu", (rt.world_size,)))
    odd_gather = BucketedFullTensors(odd, rt.device, bucket_bytes=1 << 20)
    odd_equal = all(torch.equal(odd_gather(p), p.full_tensor()) for _, p in odd.named_parameters())
    return {"gather_equal": equal, "gather_collectives": gather.collectives, "gather_requests": len(order),
            "gather_odd_equal": odd_equal, "gather_odd_collectives": odd_gather.collectives}


def main():
    rt = init_runtime(tp_size=2)
    res = {"rank": rt.rank, "tp_ranks": rt.tp_ranks, "tp_rank": rt.tp_rank, "dp_size": rt.dp_size}
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=None)
    actor = Qwen2ForCausalLM(cfg)
    attach_logprob_method(actor)
    strategy = get_strategy(StrategyConfig(), rt)
    state = strategy.prepare_trainable(actor, OptimConfig(lr=5e-2, max_grad_norm=0.0), lr=5e-2, total_steps=4)
    res["sharded"] = all(type(p).__name__ == "DTensor" for p in state.model.parameters())
    res.update(bucketed_gather_checks(state.model, rt))
    ecfg = EngineConfig(tp_size=2, block_size=4, max_num_batched_tokens=64, kv_cache_max_tokens=512)
    native = NativeEngine(cfg, ecfg, device=rt.device, dtype=torch.float32, tp_group=rt.tp_group)
    plain = HFEngine(cfg, EngineConfig(block_size=4), device=rt.device, dtype=torch.float32)
    g = torch.Generator().manual_seed(100 + rt.rank)  # different prompts (and counts) per rank
    prompts = [torch.randint(1, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (2 + rt.rank,), generator=g)]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)

    def check(tag):
        update_engine_weights(strategy, state.model, native, dtype=torch.float32)
        update_engine_weights(strategy, state.model, plain, dtype=torch.float32)
        full = dict(strategy.full_weights(state.model, torch.float32))
        res[f"{tag}_plain_equal"] = all(torch.equal(full[n], p) for n, p in plain.model.named_parameters())
        ref = Qwen2ForCausalLM(cfg)
        ref.load_state_dict(full)
        outs = gather_and_generate(native, prompts, params, rt)
        res[f"{tag}_n_outputs"] = len(outs)
        res[f"{tag}_prompts_match"] = [o.prompt_ids for o in outs] == prompts
        res[f"{tag}_native_eq_hf"] = [o.token_ids for o in outs] == hf_greedy(ref, prompts, 6)
        return [o.token_ids for o in outs]

    before = check("before")
    # one training step on different data per rank, then sync again: outputs follow the new weights
    ids = torch.randint(1, 96, (4, 10), generator=g)
    logp, _ = token_logprobs(state.model, ids, torch.ones_like(ids))
    strategy.backward(-logp.mean() / rt.world_size, state, sync_grads=True)
    res["step"] = strategy.optimizer_step(state)
    after = check("after")
    res["changed"] = before != after
    out_dir = os.environ["TIDAL_TEST_OUT"]
    with open(os.path.join(out_dir, f"rank{rt.rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
