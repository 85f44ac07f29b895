"""The trainer side of MoE actors (tidal.models.moe): the load-balancing loss as HF defines it, packed
forwards exact for MoE, and routing replay -- the experts the trainer uses are the engine's for every
token and layer, the router still learns, and a replay off by one token or one layer is caught."""

import copy

import pytest
import torch

from tests.engine.helpers import PROMPTS, engine_for, tiny_moe
from tests.tolerance import rounding_tol
from tidal.engine.base import SamplingParams
from tidal.envs.base import EnvRow
from tidal.envs.packing import pack_trajectories
from tidal.envs.trajectory import TrajectoryBuilder
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.models.moe import MoETraining, router_tap
from tidal.models.packing import PackedBatch
from tidal.models.varlen import enable_packed_attention


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _packed_lm(family, seed=0):
    model = tiny_moe(family, seed)
    attach_logprob_method(model)
    return enable_packed_attention(model)


def _batch(seed=0, lengths=(9, 14, 4, 11), prompts=(3, 5, 2, 6)):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(1, 127, (len(lengths), T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    act = (am.bool() & (torch.arange(T)[None] >= torch.tensor(prompts)[:, None])).float()
    return ids * am, am, act


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen3_5_moe"])
def test_packed_logprobs_and_aux_loss_equal_padded_hf(family):
    plain = tiny_moe(family)
    attach_logprob_method(plain)
    packed_model = enable_packed_attention(copy.deepcopy(plain))
    tap = router_tap(packed_model)
    ids, am, act = _batch()
    with torch.no_grad():
        want = token_logprobs(plain, ids, am, positions_BT=act)[0]
        hf_aux = plain(input_ids=ids, attention_mask=am, output_router_logits=True).aux_loss
        pb = PackedBatch.build(ids, am, targets_BT=act)
        tap.start()
        got = token_logprobs(packed_model, ids, am, packed=pb)[0]
        aux = tap.aux_loss(torch.arange(pb.num_tokens) < pb.num_real)
    assert pb.num_tokens > pb.num_real  # the dummy sequence is left out of the loss
    assert (got - want).abs().max() <= rounding_tol(torch.float32, want)
    assert abs(aux.item() - hf_aux.item()) <= rounding_tol(torch.float32, hf_aux)


def _rollout(engine, prompts=PROMPTS, n=2):
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, n=n, seed=0, ignore_eos=True))
    trajectories = []
    for c in out:
        b = TrajectoryBuilder(c.prompt_ids)
        b.add_turn(c.token_ids, c.logprobs, c.finish_reason, "", c.routed_experts)
        trajectories.append(b.finish(row=EnvRow(prompt_ids=c.prompt_ids, prompt_text=""), group_id=0, finish_reason="done"))
    return pack_trajectories(trajectories, pad_id=0)


def _experts_used(model):
    """A pre-hook on every MoE block's experts module: the top-k index it is handed, per layer."""
    used = {}
    blocks = [m for name, m in model.named_modules() if name.endswith("mlp") and hasattr(m, "experts")]
    for layer, block in enumerate(blocks):
        block.experts.register_forward_pre_hook(lambda m, args, layer=layer: used.__setitem__(layer, args[1].clone()))
    return used


def _replayed(trainer, rows, *, replay=True, corrupt=None):
    """Run the trainer's packed forward over ``rows`` with routing replay; returns (logp_BT, the
    packed batch, the experts every MoE layer used [N, L, K], the MoETraining)."""
    moe = MoETraining(router_tap(trainer), aux_loss_coef=0.0, replay=replay)
    used = _experts_used(trainer)
    routed = rows.routed_BTLK if corrupt is None else corrupt(rows.routed_BTLK)
    pb = PackedBatch.build(rows.sequences_BT, rows.attention_mask_BT, targets_BT=rows.action_mask_BT)
    moe.begin(pb, routed)
    logp = token_logprobs(trainer, rows.sequences_BT, rows.attention_mask_BT, packed=pb)[0]
    return logp, pb, torch.stack([used[l] for l in range(len(used))], 1), moe


def _engine_and_moved_trainer(family="qwen3_moe"):
    """An engine with the HF weights and a trainer whose weights moved a little (as after an update
    step): its own routing differs from the engine's on some tokens."""
    hf = tiny_moe(family)
    engine = engine_for(hf, block_size=4, max_num_batched_tokens=16)
    trainer = _packed_lm(family)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return engine, trainer


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen3_5_moe"])
def test_replay_uses_the_engines_experts_for_every_token_and_layer(family):
    engine, trainer = _engine_and_moved_trainer(family)
    rows = _rollout(engine)
    _, pb, used_NLK, moe = _replayed(trainer, rows)
    want_NLK = pb.pack(rows.routed_BTLK, fill=-1).long()
    have = want_NLK[:, 0, 0] >= 0
    # every token the engine routed (all but each row's last) ran on exactly the engine's experts
    assert have.sum() == pb.num_real - rows.sequences_BT.shape[0]
    assert torch.equal(used_NLK[have].sort(-1).values, want_NLK[have].sort(-1).values)
    # ... which is not what the moved trainer would choose itself
    same, compared = moe.tap.agreement(want_NLK)
    assert compared == have.sum() * moe.tap.num_layers and 0 < same < compared


@pytest.mark.parametrize("shift", ["token", "layer"])
def test_a_replay_off_by_one_token_or_layer_is_caught(shift):
    engine, trainer = _engine_and_moved_trainer()
    rows = _rollout(engine)
    dims = {"token": 1, "layer": 2}
    _, pb, used_NLK, _ = _replayed(trainer, rows, corrupt=lambda r: r.roll(1, dims=dims[shift]))
    want_NLK = pb.pack(rows.routed_BTLK, fill=-1).long()
    have = (want_NLK[:, 0, 0] >= 0) & (used_NLK[:, 0, 0] >= 0)
    assert not torch.equal(used_NLK[have].sort(-1).values, want_NLK[have].sort(-1).values)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_replay_keeps_the_router_learning_and_makes_logprobs_match_the_engine(family):
    engine, _ = _engine_and_moved_trainer(family)
    trainer = _packed_lm(family)  # the engine's weights: replay changes nothing but the path
    rows = _rollout(engine)
    logp, _, _, moe = _replayed(trainer, rows)
    mask = rows.action_mask_BT.bool()
    assert (logp[mask] - rows.rollout_logp_BT[mask]).abs().max() <= rounding_tol(torch.float32, 16.0)
    logp[mask].sum().backward()
    for router in moe.tap.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_aux_loss_is_added_with_its_coefficient_and_not_without(family):
    ids, am, act = _batch()
    pb = PackedBatch.build(ids, am, targets_BT=act)
    model = _packed_lm(family)
    for coef in (0.0, 0.5):
        moe = MoETraining(router_tap(model), aux_loss_coef=coef, replay=False)
        moe.begin(pb, None)
        token_logprobs(model, ids, am, packed=pb)
        aux, metrics = moe.after_forward(pb, None)
        assert aux.item() > 0 and metrics["aux_loss"] == aux.detach() and "router_agreement" not in metrics
        aux.backward()
        assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
        model.zero_grad()


def test_replay_without_engine_routing_is_an_error():
    ids, am, act = _batch()
    moe = MoETraining(router_tap(_packed_lm("qwen3_moe")), aux_loss_coef=0.0, replay=True)
    with pytest.raises(ValueError, match="routing_replay=rollout"):
        moe.begin(PackedBatch.build(ids, am, targets_BT=act), None)


def test_lora_on_attention_and_experts_merges_exactly_into_the_engine():
    """PEFT target_parameters adapters on the stacked experts: the HF-named merged weights equal
    PEFT's own merge, and an engine loaded with them samples the LoRA actor's logprobs."""
    from tidal.models.config import LoraConfig
    from tidal.models.lora import apply_lora, hf_weights

    actor = apply_lora(tiny_moe("qwen3_moe"), LoraConfig(
        rank=4, target_modules=["q_proj", "v_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)  # B starts at zero: make the adapters matter
    assert sum("experts" in n and "lora_" in n for n, p in actor.named_parameters() if p.requires_grad) == 8
    merged = dict(hf_weights(actor, lambda p: p.detach()))
    want = copy.deepcopy(actor).merge_and_unload().state_dict()
    assert set(merged) == set(want)
    for k, v in merged.items():
        assert (v - want[k]).abs().max() <= rounding_tol(torch.float32, want[k]), k
    engine = engine_for(tiny_moe("qwen3_moe", seed=1))
    engine.load_weights(merged.items())
    assert engine.verify_weights(list(merged.items())) == []
    (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_new_tokens=6, seed=0, ignore_eos=True))
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(actor(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1].double(), -1)
    ref = ref.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
    assert (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max() <= rounding_tol(torch.float32, 16.0)


def test_moe_settings_are_config_errors_where_nothing_reads_them():
    from tidal.config import load_config
    from tidal.config_base import ConfigError
    from tidal.models.config import MoEConfig

    with pytest.raises(ConfigError, match="'moe.routing_replay'.*dense model \\(qwen2\\)"):
        MoEConfig(routing_replay="rollout").check_model(False, "qwen2")
    with pytest.raises(ConfigError, match="'moe.aux_loss_coef'"):
        MoEConfig(aux_loss_coef=0.1).check_model(False, "llama")
    MoEConfig(routing_replay="rollout", aux_loss_coef=0.1).check_model(True, "qwen3_moe")
    with pytest.raises(ConfigError, match="'moe.routing_replay'.*rollout.partial off"):
        load_config("quickstart", ["moe.routing_replay=rollout", "rollout.partial.mode=carry", "algorithm.mismatch.mode=token_truncate"])
    assert load_config("quickstart", ["moe.routing_replay=off"]).moe.routing_replay == "off"  # YAML's off


def test_replay_holds_in_the_backward_recompute_of_gradient_checkpointing():
    engine, trainer = _engine_and_moved_trainer()
    trainer.gradient_checkpointing_enable()
    trainer.train()
    rows = _rollout(engine, prompts=PROMPTS[:2], n=1)
    logp, pb, used_forward, _ = _replayed(trainer, rows)
    used = _experts_used(trainer)  # a second pre-hook: the layers' recomputation in backward
    logp.sum().backward()
    used_backward = torch.stack([used[l] for l in range(len(used))], 1)
    assert torch.equal(used_backward, used_forward)
    want_NLK = pb.pack(rows.routed_BTLK, fill=-1).long()
    have = want_NLK[:, 0, 0] >= 0
    assert torch.equal(used_backward[have].sort(-1).values, want_NLK[have].sort(-1).values)
