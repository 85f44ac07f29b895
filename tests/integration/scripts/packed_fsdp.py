"""Run under torchrun --nproc_per_node 2 (gloo, CPU): FSDP2-sharded packed updates. The ranks hold
different rows and need different numbers of packed micro-batches; every rank runs the largest
count (the extra passes repeat a micro-batch with a zero-weight loss), so the collectives match.
The accumulated gradient must equal the unsharded padded model's gradient of the global-batch loss.
Writes $TIDAL_TEST_OUT/rank<R>.json."""

import copy
import faulthandler
import json
import os

import torch

faulthandler.dump_traceback_later(float(os.environ.get("TIDAL_TEST_HANG_S", "120")), exit=True)
torch.set_num_threads(1)

from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from tidal.algorithms import Algorithm, AlgorithmConfig, LossNormalizer  # noqa: E402
from tidal.distributed import init_runtime  # noqa: E402
from tidal.models.logprobs import attach_logprob_method, token_logprobs  # noqa: E402
from tidal.models.packing import PackedBatch  # noqa: E402
from tidal.models.varlen import enable_packed_attention  # noqa: E402
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy  # noqa: E402
from tidal.trainer.experience import packed_micro_batches  # noqa: E402

LENGTHS = [30, 28, 25, 9, 4, 20, 3, 6]  # rank 0 takes the first four (long), rank 1 the rest
PROMPT = 2


def data():
    g = torch.Generator().manual_seed(0)
    B, T = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(1, 97, (B, T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    act = (am.bool() & (torch.arange(T)[None] >= PROMPT)).float()
    old = (torch.randn(B, T, generator=g) * 0.1 - 3) * act
    adv = torch.randn(B, T, generator=g) * act
    return ids * am, am, act, old, adv


def loss_of(algo, logp, old, adv, act, norm):
    return algo.policy_loss(logp, old, adv, act, norm)[0]


def main():
    rt = init_runtime(tp_size=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=97))
    attach_logprob_method(model)
    ids, am, act, old, adv = data()
    algo = Algorithm(AlgorithmConfig())
    norm = LossNormalizer.from_mask(act)  # the global batch's counts (what the updater all-reduces)
    # reference: the unsharded, padded model on every row
    ref = copy.deepcopy(model)
    logp, _ = token_logprobs(ref, ids, am, positions_BT=act)
    loss_of(algo, logp, old, adv, act, norm).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    # sharded, packed, this rank's rows
    packed = copy.deepcopy(model)
    enable_packed_attention(packed)
    strategy = get_strategy(StrategyConfig(param_dtype="float32"), rt)
    state = strategy.prepare_trainable(packed, OptimConfig(lr=1e-3), lr=1e-3, total_steps=1)
    rows = list(range(4)) if rt.rank == 0 else list(range(4, 8))
    plan = [[rows[i] for i in b] for b in packed_micro_batches([LENGTHS[r] for r in rows], max_tokens=32, max_seqs=8)]
    total = int(rt.all_reduce_max([float(len(plan))])[0])
    for i in range(total):
        real = i < len(plan)
        b = plan[i] if real else plan[0]
        T = max(LENGTHS[r] for r in b)
        pb = PackedBatch.build(ids[b, :T], am[b, :T], targets_BT=act[b, :T])
        logp, _ = token_logprobs(state.model, ids[b, :T], am[b, :T], packed=pb)
        loss = loss_of(algo, logp, old[b, :T], adv[b, :T], act[b, :T], norm)
        strategy.backward(loss if real else loss * 0.0, state, sync_grads=i == total - 1)
    diff = max(float((p.grad.full_tensor() - want[n]).abs().max()) for n, p in state.model.named_parameters())
    scale = max(float(g.abs().max()) for g in want.values())
    res = {"rank": rt.rank, "micro_batches": len(plan), "passes": total, "max_grad_diff": diff, "grad_scale": scale}
    with open(os.path.join(os.environ["TIDAL_TEST_OUT"], f"rank{rt.rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
