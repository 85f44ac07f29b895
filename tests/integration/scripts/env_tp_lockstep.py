"""Run under torchrun --nproc_per_node 2 (gloo, CPU): multi-turn rollouts in one rollout TP group.

Both ranks share one native engine sharded over the TP group (tp_size 2). Rank 0's rows need 3
turns and their tool answers after 30 ms; rank 1's rows need 1 turn (its tool answers at once)
and it has fewer rows. The GroupGenerator must keep the engine calls in lockstep (every rank the
same calls with the same arguments) and end on the same round: with rounds of batch ``generate``
calls (an engine seen through its ``generate`` only), and continuously (the native engine's
``add``/``step``, exchanged before every step). Each rank checks its trajectories
against the same rollout run alone on an unsharded HF engine (greedy), then the single_turn case
(exactly one engine call, as a plain rollout), an environment error on one rank (every rank
raises at once), a rank without prompts, and writes $TIDAL_TEST_OUT/rank<R>.json.
"""

import faulthandler
import hashlib
import json
import os
import pickle
import time

import torch

faulthandler.dump_traceback_later(float(os.environ.get("TIDAL_TEST_HANG_S", "240")), exit=True)
torch.set_num_threads(1)

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tidal.distributed import init_runtime  # noqa: E402
from tidal.distributed.generate import GroupGenerator  # noqa: E402
from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.engine.config import EngineConfig  # noqa: E402
from tidal.engine.hf import HFEngine  # noqa: E402
from tidal.engine.native import NativeEngine  # noqa: E402
from tidal.envs import EnvConfig, EnvError, EnvRollout, EnvRow, Environment, Observation, StepResult  # noqa: E402
from tidal.tasks.chatml import train_chatml_tokenizer  # noqa: E402

OBSERVATION = [7, 8, 9]


class CountdownEnv(Environment):
    """``row.metadata["turns"]`` turns; each step answers after ``row.metadata["delay_s"]`` with
    three fixed observation tokens, the last one is done with reward 1."""

    def reset(self, row):
        self.row = row
        return Observation(token_ids=list(row.prompt_ids))

    def step(self, turn):
        time.sleep(self.row.metadata["delay_s"])
        if turn.index + 1 >= self.row.metadata["turns"]:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation=Observation(token_ids=OBSERVATION), reward=0.5)


class FailingEnv(CountdownEnv):
    """Rank 1's trajectories raise at their first step (``env.on_error: raise``); rank 0's go on."""

    def step(self, turn):
        if self.row.where.startswith("rank1"):
            raise ValueError("boom")
        return super().step(turn)


class Recorder:
    """Wraps an engine's generate: the calls (a digest of their arguments) in order."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, params, **kw):
        self.calls.append(hashlib.sha256(pickle.dumps((prompts, params))).hexdigest()[:16])
        return self.engine.generate(prompts, params, **kw)


class StepRecorder:
    """Records an incremental engine's calls (``add`` with a digest of its requests, ``step`` with
    the ids it finished) while installed on it."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.add, self.step = engine.add, engine.step
        engine.add, engine.step = self._add, self._step

    def _add(self, requests):
        self.calls.append("add " + hashlib.sha256(pickle.dumps([(r.request_id, r.prompt_ids, r.params, r.group_id)
                                                                for r in requests])).hexdigest()[:16])
        return self.add(requests)

    def _step(self):
        out = self.step()
        self.calls.append(f"step {[c.request_id for c in out]}")
        return out

    def remove(self):
        del self.engine.add, self.engine.step


def trajectories(result):
    return [(t.rows[0].input_ids, t.rows[0].action_mask, [tt.reward for tt in t.turns], t.outcome_reward, t.finish_reason)
            for t in result.trajectories]


def main():
    rt = init_runtime(tp_size=2)
    tok = train_chatml_tokenizer(["Calculate 347*29 and tell me the result.", "The answer is 10063."] * 20)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    native = NativeEngine(cfg, EngineConfig(tp_size=2, block_size=4, max_num_batched_tokens=64, kv_cache_max_tokens=2048),
                          device=rt.device, dtype=torch.float32, tp_group=rt.tp_group)
    native.load_weights(model.named_parameters())
    plain = HFEngine(cfg, EngineConfig(), device=rt.device, dtype=torch.float32)
    plain.load_weights(model.named_parameters())

    g = torch.Generator().manual_seed(100 + rt.rank)
    n_rows, turns, delay = (3, 3, 0.03) if rt.rank == 0 else (2, 1, 0.0)
    rows = [EnvRow(prompt_ids=torch.randint(20, len(tok), (int(k),), generator=g).tolist(), prompt_text="",
                   metadata={"turns": turns, "delay_s": delay}, where=f"rank{rt.rank}:{i}")
            for i, k in enumerate(torch.randint(3, 7, (n_rows,), generator=g))]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, n=2, seed=5 + rt.rank)
    env_cfg = EnvConfig(name="single_turn", max_turns=4)
    rollout = EnvRollout(env_cfg, tok, env_factory=lambda: CountdownEnv(env_cfg))

    rec = Recorder(native)
    gen = GroupGenerator(rec, rt)
    result = rollout.run(gen, rows, params)
    alone = rollout.run(plain.generate, rows, params)
    res = {
        "calls": rec.calls,
        "turns": [len(t.turns) for t in result.trajectories],
        "finish": [t.finish_reason for t in result.trajectories],
        "equal_alone": trajectories(result) == trajectories(alone),
        "n_trajectories": len(result.trajectories),
        "generate_calls": result.metrics["env/generate_calls"],
        "wait_s": result.metrics["env/wait_s"],
    }

    # continuous: the GroupGenerator over the native engine itself (incremental requests)
    rec_steps = StepRecorder(native)
    cont = rollout.run(GroupGenerator(native, rt), rows, params)
    rec_steps.remove()
    res["cont_calls"] = rec_steps.calls
    res["cont_equal_alone"] = trajectories(cont) == trajectories(alone)
    res["cont_turns"] = [len(t.turns) for t in cont.trajectories]
    res["cont_adds"] = sum(c.startswith("add") for c in rec_steps.calls)
    res["cont_idle"] = not native.has_unfinished()

    single = EnvRollout(EnvConfig(), tok)
    rec_single = Recorder(native)
    one = single.run(GroupGenerator(rec_single, rt), rows, params)
    ref = single.run(plain.generate, rows, params)
    res["single_calls"] = rec_single.calls
    res["single_equal"] = trajectories(one) == trajectories(ref)

    failing = EnvRollout(env_cfg, tok, env_factory=lambda: FailingEnv(env_cfg))  # every rank raises, none waits
    try:
        failing.run(GroupGenerator(native, rt), rows, params)  # continuous (the engine's own requests)
        res["failure"] = None
    except EnvError as e:
        res["failure"] = str(e)
    res["failure_idle"] = not native.has_unfinished()

    empty = EnvRollout(EnvConfig(), tok)  # a rank without prompts still joins the group's call
    rec_empty = Recorder(native)
    out = empty.run(GroupGenerator(rec_empty, rt), rows if rt.rank == 0 else [], params)
    res["empty_calls"] = rec_empty.calls
    res["empty_n"] = len(out.trajectories)
    with open(os.path.join(os.environ["TIDAL_TEST_OUT"], f"rank{rt.rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
