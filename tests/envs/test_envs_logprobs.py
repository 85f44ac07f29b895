"""The engine's sampling logprobs equal the trainer's logprobs on every sampled token of a
multi-turn trajectory (observation tokens in between), for the native and the HF engine."""

import pytest
import torch

from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.hf import HFEngine
from tidal.envs import EnvConfig, EnvRollout, Environment, Observation, StepResult, pack_trajectories
from tidal.models.logprobs import attach_logprob_method, token_logprobs

from tests.engine.helpers import engine_for, tiny_hf
from tests.envs.helpers import chat_row


class ThreeTurns(Environment):
    """Whatever the model says, a tool message comes back, for three turns."""

    def reset(self, row):
        return Observation(messages=row.messages)

    def step(self, turn):
        if turn.index == 2:
            return StepResult(done=True)
        return StepResult(observation=Observation(messages=[{"role": "tool", "content": f"result {turn.index}"}]))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("backend, device", [
    ("native", "cpu"), ("hf", "cpu"),
    pytest.param("native", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_rollout_logprobs_equal_trainer_logprobs_on_sampled_tokens(qwen25_tok, backend, device):
    tok = qwen25_tok
    model = tiny_hf("qwen2", vocab_size=len(tok), max_position_embeddings=512).to(device)
    if backend == "native":
        engine = engine_for(model, device=device, kv_cache_max_tokens=4096)
    else:
        engine = HFEngine(model.config, EngineConfig(backend="hf"), device=torch.device("cpu"), dtype=torch.float32)
        engine.load_weights(model.named_parameters())
    cfg = EnvConfig(max_tokens_per_turn=6, max_turns=3)
    rows = [chat_row(tok, "Calculate 1+2", where="r:0"), chat_row(tok, "Calculate 3+4", where="r:1")]
    result = EnvRollout(cfg, tok, env_factory=lambda: ThreeTurns(cfg)).run(
        engine.generate, rows, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=0))
    packed = pack_trajectories(result.trajectories, pad_id=tok.pad_token_id)
    act = packed.action_mask_BT
    assert (act.sum(-1) > 0).all()
    gapped = [t for t in result.trajectories if len(t.turns) > 1]
    assert gapped, "no trajectory reached a second turn"  # the test must cover observation gaps
    attach_logprob_method(model)
    with torch.no_grad():
        logp_BT, _ = token_logprobs(model, packed.sequences_BT.to(device), packed.attention_mask_BT.to(device),
                                    positions_BT=act.to(device))
    mask = act.bool()
    diff = (logp_BT.cpu()[mask] - packed.rollout_logp_BT[mask]).abs().max()
    assert diff < (2e-4 if device == "cpu" else 2e-3), diff  # fp32 on both sides (TF32 kernels on CUDA)
