"""The native engine's MoE families (Qwen3-MoE, OLMoE, Qwen3.5-MoE on the hybrid backbone) against
Hugging Face on tiny random models (CPU, fp32): logprobs of prefill and decode, greedy outputs, the
expert GEMM paths, TP shards of the stacked experts, weight read-back -- and a routing or a shared
expert gate that is slightly wrong fails."""

import pytest
import torch

from tests.tolerance import rounding_tol
from tidal.engine.base import SamplingParams
from tidal.engine.native.moe.dispatch import combine, dispatch
from tidal.engine.native.moe.experts import FusedExperts
from tidal.models.routing import replay_weights, route
from tidal.engine.native.kernels.torch_ops import TorchOps
from tidal.engine.native.parallel import TPGroup

from .helpers import PROMPTS, engine_for, hf_greedy, tiny_moe

FAMILIES = ["qwen3_moe", "olmoe", "qwen3_5_moe"]


def _hf_logprobs(hf, prompt, tokens):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def _max_logprob_error(hf, engine, n_new=8):
    # sampled at temperature 1: the first token's logprob comes from the prefill, the rest from decode
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=n_new, seed=0, ignore_eos=True))
    err, mag = 0.0, 0.0
    for c in out:
        ref = _hf_logprobs(hf, c.prompt_ids, c.token_ids)
        err = max(err, (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max().item())
        mag = max(mag, ref.abs().max().item())
    return err, mag


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_logprobs_equal_hf(family):
    hf = tiny_moe(family)
    err, mag = _max_logprob_error(hf, engine_for(hf, block_size=4, max_num_batched_tokens=16))
    assert err <= rounding_tol(torch.float32, max(mag, 8.0)), err


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_64_tokens_equal_hf_generate(family):
    hf = tiny_moe(family)
    engine = engine_for(hf, block_size=4, max_num_batched_tokens=16)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
    for prompt, c in zip(PROMPTS, out):
        assert c.token_ids == hf_greedy(hf, prompt, 64)


@pytest.mark.parametrize("wrong", ["no_renormalisation", "top_k_minus_one"])
def test_a_slightly_wrong_routing_fails(wrong):
    hf = tiny_moe("qwen3_moe")
    engine = engine_for(hf, block_size=4)
    for layer in engine.model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and wrong == "no_renormalisation":
            gate.norm_topk_prob = False
        elif gate is not None:
            gate.top_k -= 1
    engine.model.routing_sink.top_k -= wrong == "top_k_minus_one"  # the record's width follows
    err, mag = _max_logprob_error(hf, engine)
    assert err > 1000 * rounding_tol(torch.float32, max(mag, 8.0)), err


@pytest.mark.parametrize("wrong", ["ungated", "gate_scaled_1_percent"])
def test_a_wrong_shared_expert_gate_fails(wrong):
    """Qwen3.5-MoE's shared expert is scaled by sigmoid(x w_g): without the gate, or with w_g off by
    1%, the engine's logprobs leave HF's by far more than rounding."""
    hf = tiny_moe("qwen3_5_moe")
    engine = engine_for(hf, block_size=4)
    for layer in engine.model.model.layers:
        if wrong == "ungated":
            layer.mlp.shared_expert_gate.forward = lambda x_TH: torch.ones(x_TH.shape[0], 1)
        else:
            layer.mlp.shared_expert_gate.weight.data.mul_(1.01)
    err, mag = _max_logprob_error(hf, engine)
    assert err > 100 * rounding_tol(torch.float32, max(mag, 8.0)), err


def _experts(tp=TPGroup(None, 0, 1), E=5, H=16, I=12, seed=0):
    ex = FusedExperts(E, H, I, tp, TorchOps(), torch.float32)
    g = torch.Generator().manual_seed(seed)
    full = {"gate_up_proj": torch.randn(E, 2 * I, H, generator=g), "down_proj": torch.randn(E, H, I, generator=g)}
    for name, t in full.items():
        for dst, src in ex.weight_slices(getattr(ex, name), t):
            dst.copy_(src)
    return ex, full


def _reference_moe(x_TH, routing, full):
    """HF's per-expert loop, written out: sum_k w_tk * down_e(silu(gate_e x) * up_e x)."""
    out = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        for w, e in zip(routing.weights_TK[t], routing.experts_TK[t]):
            gate, up = (full["gate_up_proj"][e] @ x_TH[t]).chunk(2)
            out[t] += w * (full["down_proj"][e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_expert_gemm_paths_equal_the_per_token_reference(impl):
    ex, full = _experts()
    x_TH = torch.randn(9, 16)
    routing = route(torch.randn(9, 5), top_k=2, norm_topk_prob=True)
    routing.experts_TK[0] = torch.tensor([4, 3])  # expert 0 may get no rows: empty groups are fine
    ex.impl = impl
    out = ex(x_TH, routing)
    ref = _reference_moe(x_TH, routing, full)
    assert torch.allclose(out, ref, atol=rounding_tol(torch.float32, ref.abs().max() * 16))


def test_tp_shards_of_the_stacked_experts_sum_to_the_whole():
    x_TH = torch.randn(7, 16)
    routing = route(torch.randn(7, 5), top_k=3, norm_topk_prob=False)
    whole, full = _experts()
    parts = []
    for rank in range(2):
        ex, _ = _experts(TPGroup(None, rank, 2))
        assert ex.gate_up_proj.shape == (5, 12, 16) and ex.down_proj.shape == (5, 16, 6)
        d = dispatch(routing, 5)
        parts.append(combine(ex._loop(x_TH[d.token_N], d), d, 7))  # the rank's share before the all-reduce
    ref = whole(x_TH, routing)
    assert torch.allclose(parts[0] + parts[1], ref, atol=rounding_tol(torch.float32, ref.abs().max() * 16))


def test_tp_shards_loaded_per_expert_equal_the_stacked_ones():
    """Per-expert checkpoint tensors (:func:`tidal.families.expert_weight`) land in each TP rank's
    slice exactly as the stacked tensors do."""
    from tidal.families import expert_weight

    for rank in range(2):
        stacked, full = _experts(TPGroup(None, rank, 2))
        ex = FusedExperts(5, 16, 12, TPGroup(None, rank, 2), TorchOps(), torch.float32)
        for e in range(5):
            for proj, t in (("gate_proj", full["gate_up_proj"][e, :12]), ("up_proj", full["gate_up_proj"][e, 12:]),
                            ("down_proj", full["down_proj"][e])):
                w = expert_weight(f"model.layers.0.mlp.experts.{e}.{proj}.weight")
                for dst, src in ex.weight_slices(getattr(ex, w.stacked.rpartition(".")[2]), t, w):
                    dst.copy_(src)
        assert torch.equal(ex.gate_up_proj, stacked.gate_up_proj) and torch.equal(ex.down_proj, stacked.down_proj)


def test_replay_weights_equal_route_for_its_own_choice_and_carry_gradient():
    logits = torch.randn(6, 8, requires_grad=True)
    for norm in (False, True):
        r = route(logits, 3, norm)
        w = replay_weights(logits, r.experts_TK, norm)
        assert torch.equal(w, r.weights_TK)
    replay_weights(logits, torch.randint(0, 8, (6, 3)), True).pow(2).sum().backward()
    assert logits.grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_weights_sync_and_read_back(family):
    hf = tiny_moe(family)
    engine = engine_for(hf)
    named = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    assert engine.verify_weights(named) == []
    engine.model.model.layers[2].mlp.experts.down_proj.data[3, 0, 0] += 1.0
    assert engine.verify_weights(named) == ["model.layers.2.mlp.experts.down_proj"]
    with pytest.raises(KeyError, match="mlp.experts.up_proj"):
        engine.load_weights([("model.layers.0.mlp.experts.up_proj", torch.zeros(1))])


def _hf_routing(hf, tap, fed):
    tap.start()
    with torch.no_grad():
        hf(torch.tensor([fed]))
    return torch.stack([tap.chosen[l] for l in range(tap.num_layers)], 1).sort(-1).values  # [T, L, K]


@pytest.mark.parametrize("family,kv_tokens", [("qwen3_moe", None), ("olmoe", None), ("qwen3_moe", 48),
                                               ("qwen3_5_moe", None), ("qwen3_5_moe", 48)])
def test_engine_records_the_routing_of_every_token_it_fed(family, kv_tokens):
    """Prefix-cache hits (n=2 shares the prompt's blocks), chunked prefill, decode and (with a small
    cache) preemption and recompute: every fed token's experts, per MoE layer, are HF's."""
    from tidal.models.moe import router_tap

    hf = tiny_moe(family)
    tap = router_tap(hf)
    cfg = {"kv_cache_max_tokens": kv_tokens} if kv_tokens else {}
    engine = engine_for(hf, block_size=4, max_num_batched_tokens=16, **cfg)
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=0, ignore_eos=True))
    assert engine.stats["prefix_hit_tokens"] > 0 and (kv_tokens is None or engine.stats["preemptions"] > 0)
    for c in out:
        fed = c.prompt_ids + c.token_ids[:-1]
        assert c.routed_experts.shape == (len(fed), tap.num_layers, tap.top_k)
        engine_TLK = torch.from_numpy(c.routed_experts).long().sort(-1).values
        assert torch.equal(engine_TLK, _hf_routing(hf, tap, fed))


def test_dense_models_record_no_routing():
    from .helpers import tiny_hf

    (c,) = engine_for(tiny_hf("qwen3")).generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    assert c.routed_experts is None


def test_decode_steps_count_the_distinct_experts_they_touch():
    hf = tiny_moe("qwen3_moe")
    engine = engine_for(hf)
    engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    layers, k = engine.model.routing_sink.num_layers, engine.model.routing_sink.top_k
    one = dict(engine.stats)
    assert one["moe_decode_steps"] == 4 and one["moe_experts_touched"] == 4 * layers * k  # one row: its top-k
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=2, seed=0, ignore_eos=True))
    steps = engine.stats["moe_decode_steps"] - one["moe_decode_steps"]
    touched = engine.stats["moe_experts_touched"] - one["moe_experts_touched"]
    assert steps == 1  # four rows decode their second token together: the union of their choices
    want = sum(len({e for c in out for e in c.routed_experts[-1, l].tolist()}) for l in range(layers))
    assert touched == want and layers * k < want <= layers * 8


def test_first_tokens_follow_hfs_distribution_chi_square():
    """2,000 samples of a prompt's next token from the MoE engine against HF's softmax (the sampler's
    chi-square test at the 0.999 quantile)."""
    from .test_sampler import _chi2_exceeds

    hf = tiny_moe("qwen3_moe")
    engine = engine_for(hf, max_num_seqs=512)
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_new_tokens=1, n=2000, seed=0, ignore_eos=True))
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out]), minlength=hf.config.vocab_size)
    with torch.no_grad():
        p_V = torch.softmax(hf(torch.tensor([PROMPTS[0]])).logits[0, -1].double(), -1)
    assert not _chi2_exceeds(counts, p_V)
    assert _chi2_exceeds(counts, p_V.roll(1))  # the test can fail: a distribution off by one token id


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_routing_stays_exact_across_sleep_and_wake(family):
    from tidal.models.moe import router_tap

    hf = tiny_moe(family)
    tap = router_tap(hf)
    engine = engine_for(hf, block_size=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=1, ignore_eos=True)
    engine.generate(PROMPTS[2:], params)
    engine.sleep(1)
    engine.wake_up()
    for c in engine.generate(PROMPTS[:2], params):
        fed = c.prompt_ids + c.token_ids[:-1]
        assert torch.equal(torch.from_numpy(c.routed_experts).long().sort(-1).values, _hf_routing(hf, tap, fed))


def test_qwen3_5_moe_conditional_generation_checkpoint_text_tower(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration's weights (model.language_model.*, the vision tower
    skipped) load into the same engine model, which then samples the text model's logprobs; the
    trainer loads the checkpoint as its text decoder (text-only RL)."""
    import transformers

    from tidal.models.loading import load_causal_lm

    from .helpers import MOE_COMMON, MOE_FAMILIES

    hf = tiny_moe("qwen3_5_moe")
    text = {**MOE_COMMON, **MOE_FAMILIES["qwen3_5_moe"][2]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    vl = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision))
    vl.model.language_model.load_state_dict(hf.model.state_dict())
    vl.lm_head.load_state_dict(hf.lm_head.state_dict())
    engine = engine_for(vl.eval())
    assert engine.verify_weights(vl.state_dict().items()) == []
    (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_new_tokens=6, seed=0, ignore_eos=True))
    ref = _hf_logprobs(hf, c.prompt_ids, c.token_ids)
    assert (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max() <= rounding_tol(torch.float32, 16.0)
    vl.save_pretrained(tmp_path)
    actor = load_causal_lm(str(tmp_path))
    assert type(actor).__name__ == "Qwen3_5MoeForCausalLM"
    want = hf.model.state_dict()
    assert all(torch.equal(p, want[name]) for name, p in actor.model.state_dict().items())
    # the engine reads the same folder (per-expert weights under model.language_model.*, a vision tower)
    err, mag = _max_logprob_error(hf, _from_folder(tmp_path))
    assert err <= rounding_tol(torch.float32, max(mag, 8.0)), err


def _from_folder(path):
    from tidal.engine.config import EngineConfig
    from tidal.engine.native import NativeEngine

    return NativeEngine.from_pretrained(str(path), EngineConfig(block_size=4, max_num_batched_tokens=16),
                                        device=torch.device("cpu"), dtype=torch.float32)


def _write_by_hand(hf, path, per_expert: bool):
    """The model's weights in two safetensors files, with no help from ``save_pretrained``: one tensor
    per expert and projection (released checkpoints' layout), each layer's experts spread over both
    files and out of order; or the stacked experts as ``transformers`` 5 holds them in memory."""
    from safetensors.torch import save_file

    hf.config.save_pretrained(path)
    state = {}
    for name, t in hf.state_dict().items():
        if per_expert and name.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                state[f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :half]
                state[f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, half:]
        elif per_expert and name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                state[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            state[name] = t
    names = sorted(state, reverse=True)
    for i in range(2):
        save_file({n: state[n].contiguous() for n in names[i::2]}, str(path / f"model-0000{i + 1}-of-00002.safetensors"))
    return state


@pytest.mark.parametrize("layout", ["save_pretrained", "per_expert_by_hand", "stacked_by_hand"])
@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_loads_moe_checkpoints_as_saved(family, layout, tmp_path):
    """``NativeEngine.from_pretrained`` on a folder of each MoE family: what ``save_pretrained`` writes
    (transformers 5.25: one tensor per expert), per-expert weights written by hand over two files,
    and the stacked layout. The experts' names map through :func:`tidal.families.expert_weight`; the
    engine then samples HF's logprobs and holds exactly HF's weights (failed before: ``KeyError:
    weight 'model.layers.0.mlp.experts.0.down_proj.weight' has no place``)."""
    from safetensors import safe_open

    hf = tiny_moe(family)
    if layout == "save_pretrained":
        hf.save_pretrained(tmp_path)
    else:
        _write_by_hand(hf, tmp_path, per_expert=layout == "per_expert_by_hand")
    keys = set()
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            keys |= set(fh.keys())
    assert any(".experts.0.down_proj.weight" in k for k in keys) == (layout != "stacked_by_hand")  # the layout under test
    engine = _from_folder(tmp_path)
    assert engine.verify_weights(hf.state_dict().items()) == []
    err, mag = _max_logprob_error(hf, engine)
    assert err <= rounding_tol(torch.float32, max(mag, 8.0)), err


def test_a_per_expert_weight_of_a_missing_expert_is_refused(tmp_path):
    hf = tiny_moe("olmoe")
    engine = engine_for(hf)
    w = hf.state_dict()["model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(KeyError, match="expert 8 of a layer with 8 experts"):
        engine.load_weights([("model.layers.0.mlp.experts.8.down_proj.weight", w[0])])
    # one expert's projection lands in its slice only
    engine.load_weights([("model.layers.0.mlp.experts.2.up_proj.weight", torch.full((32, 64), 7.0))])
    gate_up = engine.model.model.layers[0].mlp.experts.gate_up_proj
    assert (gate_up[2, 32:] == 7.0).all() and not (gate_up[2, :32] == 7.0).any() and not (gate_up[1] == 7.0).any()
