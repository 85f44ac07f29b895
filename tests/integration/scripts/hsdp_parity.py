"""Run under torchrun --nproc_per_node 4 (gloo, CPU). Hybrid sharding (strategy.shard=2: a 2 x 2 mesh,
replicate x shard) against full sharding (strategy.shard=world) from the same weights and data:
losses, gradients and the stepped weights; which shard each rank holds; weight sync from the
hybrid layout (bucketed, verified by read-back); a DCP checkpoint of the hybrid layout loaded into
the full one. With deepspeed installed (DS_ACCELERATOR=cpu), also ZeRO-3 with strategy.shard=2
(ZeRO++ hierarchical partitioning): the same losses, and each parameter's secondary partition.

Writes $TIDAL_TEST_OUT/rank<R>.json.
"""

import faulthandler
import json
import os

import torch

faulthandler.dump_traceback_later(float(os.environ.get("TIDAL_TEST_HANG_S", "240")), exit=True)
torch.set_num_threads(1)

import torch.distributed.checkpoint as dcp  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tidal.distributed import init_runtime  # noqa: E402
from tidal.engine.config import EngineConfig  # noqa: E402
from tidal.engine.hf import HFEngine  # noqa: E402
from tidal.models.logprobs import attach_logprob_method, token_logprobs  # noqa: E402
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy  # noqa: E402
from tidal.strategy.gather import BucketedFullTensors  # noqa: E402
from tidal.sync import update_engine_weights  # noqa: E402

CFG = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, tie_word_embeddings=False, eos_token_id=None)


def prepared(rt, shard, weights):
    model = Qwen2ForCausalLM(CFG)
    model.load_state_dict(weights)
    attach_logprob_method(model)
    strategy = get_strategy(StrategyConfig(shard=shard), rt)
    return strategy, strategy.prepare_trainable(model, OptimConfig(lr=1e-2, max_grad_norm=1.0), lr=1e-2, total_steps=4)


def train(rt, strategy, state, batches, grads=True):
    """Two optimizer steps; per step the global loss, the full gradients and the step's metrics."""
    out = []
    for ids in batches:
        logp, _ = token_logprobs(state.model, ids, torch.ones_like(ids))
        loss = -logp.mean() / rt.world_size  # this rank's share of the global loss
        strategy.backward(loss, state, sync_grads=True)
        full = {n: p.grad.full_tensor() for n, p in state.model.named_parameters()} if grads else {}
        metrics = strategy.optimizer_step(state)
        out.append((rt.all_reduce_sum([float(loss.detach())])[0], full, metrics))
    return out


def deepspeed_hpz(rt, weights, batches):
    """ZeRO-3 with ``zero_hpz_partition_size`` 2: losses, grad norms, full weights, secondary partition sizes."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {}
    model = Qwen2ForCausalLM(CFG)
    model.load_state_dict(weights)
    attach_logprob_method(model)
    strategy = get_strategy(StrategyConfig(backend="deepspeed", shard=2), rt)
    state = strategy.prepare_trainable(model, OptimConfig(lr=1e-2, max_grad_norm=1.0), lr=1e-2, total_steps=4)
    out = train(rt, strategy, state, batches, grads=False)
    module = state.model.module
    return {
        "ds_losses": [x[0] for x in out], "ds_grad_norms": [x[2]["grad_norm"] for x in out],
        "ds_weights": {n: t.tolist() for n, t in strategy.full_weights(state.model, torch.float32) if n.endswith("norm.weight")},
        "ds_secondary": all(p.ds_secondary_tensor is not None and p.ds_secondary_tensor.numel() == -(-p.ds_numel // 2)
                            for p in module.parameters()),
    }


def main():
    rt = init_runtime(tp_size=1)
    torch.manual_seed(0)
    weights = Qwen2ForCausalLM(CFG).state_dict()
    g = torch.Generator().manual_seed(10 + rt.rank)  # different data per rank
    batches = [torch.randint(1, 64, (2, 8), generator=g) for _ in range(2)]
    full_s, full = prepared(rt, "world", weights)
    hyb_s, hyb = prepared(rt, 2, weights)
    res = {"rank": rt.rank}
    a, b = train(rt, full_s, full, batches), train(rt, hyb_s, hyb, batches)
    res["losses"] = [[x[0] for x in a], [x[0] for x in b]]
    res["grad_norms"] = [[x[2]["grad_norm"] for x in a], [x[2]["grad_norm"] for x in b]]
    res["grad_max_diff"] = max(float((ga[n] - gb[n]).abs().max()) for (_, ga, _), (_, gb, _) in zip(a, b) for n in ga)
    full_w = {n: p.full_tensor() for n, p in full.model.named_parameters()}
    hyb_w = {n: p.full_tensor() for n, p in hyb.model.named_parameters()}
    res["weight_max_diff"] = max(float((full_w[n] - hyb_w[n]).abs().max()) for n in full_w)
    res["weight_max_change"] = max(float((hyb_w[n] - weights[n]).abs().max()) for n in hyb_w)

    # the layout: a (replicate 2, shard 2) mesh of consecutive blocks; this rank holds chunk rank % 2
    p0 = next(hyb.model.parameters())
    res["mesh"] = p0.device_mesh.mesh.tolist()
    res["placements"] = sorted({str(tuple(p.placements)) for p in hyb.model.parameters()})
    res["holds_its_chunk"] = all(torch.equal(p.to_local(), torch.chunk(hyb_w[n], 2, dim=0)[rt.rank % 2])
                                 for n, p in hyb.model.named_parameters())
    res["local_rows"] = {n: p.to_local().shape[0] for n, p in hyb.model.named_parameters() if n.endswith("embed_tokens.weight")}

    # weight sync from the hybrid layout: bucketed gather, verified by read-back in the engine
    gather = BucketedFullTensors(hyb.model, rt.device, bucket_bytes=4 << 10)
    res["gather_equal"] = all(torch.equal(gather(p), hyb_w[n]) for n, p in hyb.model.named_parameters())
    res["gather_collectives"] = gather.collectives
    res["gather_params"] = len(hyb_w)
    engine = HFEngine(CFG, EngineConfig(block_size=4), device=rt.device, dtype=torch.float32)
    res["sync_bytes"] = update_engine_weights(hyb_s, hyb.model, engine, dtype=torch.float32, verify=True)
    res["engine_equal"] = all(torch.equal(hyb_w[n], p) for n, p in engine.model.named_parameters())

    # a DCP checkpoint of the hybrid layout loads into the fully sharded one (weights and AdamW state)
    path = os.path.join(os.environ["TIDAL_TEST_OUT"], "ckpt")
    dcp.save({"actor": hyb_s.state_dict(hyb)}, checkpoint_id=path)
    torch.manual_seed(1)
    other_s, other = prepared(rt, "world", Qwen2ForCausalLM(CFG).state_dict())
    train(rt, other_s, other, batches[:1])  # AdamW state exists to load into
    into = {"actor": other_s.state_dict(other)}
    dcp.load(into, checkpoint_id=path)
    other_s.load_state_dict(other, into["actor"])
    res["dcp_weights_equal"] = all(torch.equal(p.full_tensor(), hyb_w[n]) for n, p in other.model.named_parameters())
    hyb_opt, other_opt = hyb_s.state_dict(hyb)["optimizer"]["state"], other_s.state_dict(other)["optimizer"]["state"]
    res["dcp_moments_equal"] = all(torch.equal(hyb_opt[n]["exp_avg"].full_tensor(), other_opt[n]["exp_avg"].full_tensor())
                                   for n in hyb_opt)
    res["norm_weights"] = {n: t.tolist() for n, t in hyb_w.items() if n.endswith("norm.weight")}
    res.update(deepspeed_hpz(rt, weights, batches))
    with open(os.path.join(os.environ["TIDAL_TEST_OUT"], f"rank{rt.rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
