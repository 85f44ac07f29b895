"""Packed (padding-free) forwards equal padded ones on CPU in fp32: token logprobs and entropies,
critic values, the policy and value losses, and every parameter's gradient -- for a plain model, a
LoRA actor and an FSDP2-sharded one (one rank). Micro-batches planned by real tokens accumulate to
the same gradient as one padded batch.

Tolerances (fp32, CPU): logprobs/entropies/values atol 1e-5; losses rtol 1e-5; gradients atol 1e-5,
rtol 1e-4 (the two layouts sum the same terms in different orders)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

from tidal.sampling_filter import SamplingFilter
from tidal.algorithms import Algorithm, AlgorithmConfig, LossNormalizer
from tidal.models.loading import critic_values
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.models.packing import PackedBatch
from tidal.models.varlen import enable_packed_attention, uses_packed_attention
from tidal.trainer.experience import packed_micro_batches

LOGP = dict(atol=1e-5, rtol=1e-5)
GRAD = dict(atol=1e-5, rtol=1e-4)
CFG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
           vocab_size=97, tie_word_embeddings=True)


def _lm(seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**CFG))
    attach_logprob_method(model)
    return model


def _pair(model):
    """(the model, a packed copy with the same weights; deepcopy rebinds the copy's logprob method to it)."""
    packed = copy.deepcopy(model)
    enable_packed_attention(packed)
    return model, packed


def _batch(seed=0, lengths=(9, 14, 4, 11, 7, 2), prompts=(3, 5, 2, 6, 1, 1)):
    """Right-padded ids, attention mask and action mask (response tokens after each prompt)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(1, 97, (B, T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    act = (am.bool() & (torch.arange(T)[None] >= torch.tensor(prompts)[:, None])).float()
    return ids * am, am, act


def test_logprobs_and_entropies_equal_padded():
    plain, packed = _pair(_lm())
    ids, am, act = _batch()
    with torch.no_grad():
        want, want_ent = token_logprobs(plain, ids, am, positions_BT=act, with_entropy=True, sampling=SamplingFilter(temperature=0.7))
        pb = PackedBatch.build(ids, am, targets_BT=act)
        got, got_ent = token_logprobs(packed, ids, am, packed=pb, with_entropy=True, sampling=SamplingFilter(temperature=0.7))
    assert pb.num_tokens > pb.num_real  # a dummy sequence is packed too, and changes nothing
    torch.testing.assert_close(got, want, **LOGP)
    torch.testing.assert_close(got_ent, want_ent, **LOGP)
    assert (got[act == 0] == 0).all()


def _policy_grads(model, ids, am, act, batches, *, packed: bool):
    """Sum over micro-batches of the GRPO/PPO loss shares (KL and entropy terms on), as the updater
    computes them; returns (total loss, {name: grad})."""
    algo = Algorithm(AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01))
    g = torch.Generator().manual_seed(3)
    old_BT = (torch.randn(ids.shape, generator=g) * 0.1 - 3.0) * act
    ref_BT = (torch.randn(ids.shape, generator=g) * 0.1 - 3.0) * act
    adv_BT = torch.randn(ids.shape, generator=g) * act
    norm = LossNormalizer.from_mask(act)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for rows in batches:
        T = int(am[rows].sum(-1).max())
        i, a, m = ids[rows, :T], am[rows, :T], act[rows, :T]
        if packed:
            logp, ent = token_logprobs(model, i, a, packed=PackedBatch.build(i, a, targets_BT=m), with_entropy=True)
        else:
            logp, ent = token_logprobs(model, i, a, positions_BT=m, with_entropy=True)
        loss, _ = algo.policy_loss(logp, old_BT[rows, :T], adv_BT[rows, :T], m, norm, ref_logp_BT=ref_BT[rows, :T], entropy_BT=ent)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_policy_loss_and_gradients_equal_padded_over_micro_batches(checkpointing):
    plain, packed = _pair(_lm())
    if checkpointing:  # the packed arguments reach the recomputed layers too
        packed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, am, act = _batch()
    lengths = am.sum(-1).tolist()
    want_loss, want = _policy_grads(plain, ids, am, act, [list(range(len(lengths)))], packed=False)
    plan = packed_micro_batches(lengths, max_tokens=20, max_seqs=4)
    assert len(plan) > 2  # several packed micro-batches accumulate to the one padded batch
    got_loss, got = _policy_grads(packed, ids, am, act, plan, packed=True)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert got.keys() == want.keys() and len(want) == len(list(plain.parameters()))
    for n in want:
        torch.testing.assert_close(got[n], want[n], **GRAD, msg=n)


def test_lora_actor_packed_equals_padded():
    from tidal.models.config import LoraConfig
    from tidal.models.lora import apply_lora

    plain = apply_lora(_lm(), LoraConfig(rank=4, alpha=8), seed=0)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    plain, packed = _pair(plain)
    assert uses_packed_attention(packed) and not uses_packed_attention(plain)
    ids, am, act = _batch(seed=1)
    all_rows = [list(range(ids.shape[0]))]
    want_loss, want = _policy_grads(plain, ids, am, act, all_rows, packed=False)
    got_loss, got = _policy_grads(packed, ids, am, act, all_rows, packed=True)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert got.keys() == want.keys() and all(".lora_" in n for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **GRAD, msg=n)


def test_critic_values_and_value_loss_gradients_equal_padded():
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_config(Qwen2Config(**CFG, num_labels=1, classifier_dropout=0.0))
    packed = copy.deepcopy(critic)
    enable_packed_attention(packed)
    ids, am, act = _batch(seed=2)
    returns_BT = torch.randn(ids.shape) * act
    grads = []
    for model, run in ((critic, lambda: critic_values(critic, ids, am)),
                       (packed, lambda: critic_values(packed, ids, am, packed=PackedBatch.build(ids, am, targets_BT=act)))):
        values = run()
        loss = (((values - returns_BT) * act) ** 2).sum() / act.sum()
        loss.backward()
        grads.append((values.detach() * act, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want_v, want), (got_v, got) = grads
    torch.testing.assert_close(got_v, want_v, **LOGP)
    with torch.no_grad():  # a padded call on the switched critic is packed on the fly
        real = am.float()
        real[:, 0] = 0
        torch.testing.assert_close(critic_values(packed, ids, am), critic_values(critic, ids, am) * real, **LOGP)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **GRAD, msg=n)


def test_a_switched_model_packs_padded_calls_itself():
    plain, packed = _pair(_lm())
    ids, am, act = _batch()
    with torch.no_grad():
        for positions in (act, None):
            want, _ = token_logprobs(plain, ids, am, positions_BT=positions)
            got, _ = token_logprobs(packed, ids, am, positions_BT=positions)
            real = (act if positions is not None else am.float()).clone()
            real[:, 0] = 0  # a row's first token has no prediction
            torch.testing.assert_close(got, want * real, **LOGP)


def test_misuse_is_an_error():
    plain, packed = _pair(_lm())
    ids, am, act = _batch()
    with pytest.raises(ValueError, match="not switched to packed attention"):
        token_logprobs(plain, ids, am, packed=PackedBatch.build(ids, am))
    with pytest.raises(RuntimeError, match="packed forwards only"):
        packed(input_ids=ids, attention_mask=am)  # a plain HF forward would attend across sequences
    with pytest.raises(ValueError, match="positions_BT=None"):
        token_logprobs(packed, ids, am, positions_BT=act, packed=PackedBatch.build(ids, am, targets_BT=act))


@pytest.fixture
def runtime():
    from tidal.distributed.runtime import init_runtime, shutdown

    rt = init_runtime(1, "cpu")
    yield rt
    shutdown()


def test_fsdp2_sharded_actor_packed_equals_padded(runtime):
    from tidal.strategy import OptimConfig, StrategyConfig, get_strategy

    strategy = get_strategy(StrategyConfig(param_dtype="float32", compile="off"), runtime)
    plain, packed = _pair(_lm())
    states = [strategy.prepare_trainable(m, OptimConfig(lr=1e-3), lr=1e-3, total_steps=1) for m in (plain, packed)]
    ids, am, act = _batch(seed=4)
    rows = [list(range(ids.shape[0]))]
    want_loss, want = _policy_grads(states[0].model, ids, am, act, rows, packed=False)
    got_loss, got = _policy_grads(states[1].model, ids, am, act, rows, packed=True)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for n in want:
        torch.testing.assert_close(got[n].full_tensor(), want[n].full_tensor(), **GRAD, msg=n)


@pytest.mark.slow
def test_compiled_layers_never_recompile_on_new_packed_shapes(runtime, monkeypatch):
    """``strategy.compile=on``: one graph per grad mode serves every layer and every packed shape
    (other lengths, sequence counts, longest sequences, bucketed or not); after the first iteration
    nothing compiles again. Dynamo's guards are what is tested, so the cheap ``aot_eager`` backend
    stands in for Inductor."""
    import functools

    from torch._dynamo.utils import counters

    from tidal.logging.compile import CompileMonitor
    from tidal.strategy import OptimConfig, StrategyConfig, get_strategy

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    strategy = get_strategy(StrategyConfig(compile="on", compile_cache_dir="off"), runtime)
    _, model = _pair(_lm())
    state = strategy.prepare_trainable(model, OptimConfig(lr=1e-3), lr=1e-3, total_steps=1)
    messages = []
    with CompileMonitor(messages.append) as monitor:
        for step, lengths in enumerate([(9, 14, 4), (30, 2), (1, 5, 1, 7, 3, 3), (60,), (8, 8, 8, 8)]):
            ids, am, act = _batch(seed=step, lengths=lengths, prompts=[1] * len(lengths))
            pb = PackedBatch.build(ids, am, targets_BT=act, bucket=step % 2 == 0)
            logp, ent = token_logprobs(state.model, ids, am, packed=pb, with_entropy=True)
            (logp.sum() + ent.sum()).backward()
            with torch.no_grad():
                token_logprobs(state.model, ids, am, packed=pb)
            m = monitor.pop()
            if step == 0:
                assert m["compile/graphs"] >= 2 and m["time/compile"] > 0
    assert m["compile/recompiles"] == 0, messages
    assert len(messages) == 1 and "compiling" in messages[0]
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # with and without grad
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_switching_one_model_leaves_its_config_and_new_models_alone():
    """A rollout engine built from the actor's config (HFEngine) must keep SDPA."""
    model = _lm()
    enable_packed_attention(model)
    assert uses_packed_attention(model) and model.config._attn_implementation != "tidal_varlen"
    assert all(m.config._attn_implementation == "tidal_varlen" for m in model.model.modules() if hasattr(m, "config"))
    fresh = AutoModelForCausalLM.from_config(model.config)
    attach_logprob_method(fresh)
    assert not uses_packed_attention(fresh)
    ids, am, _ = _batch()
    token_logprobs(fresh, ids, am)  # a padded forward, as before
