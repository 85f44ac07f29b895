"""env.lockstep: multi-turn rollouts with sampling are the same for the same seed, whatever the
tools' timing (an engine's random numbers are drawn per call, for its batch as a whole)."""

import random
import time

from tidal.engine.base import Completion, SamplingParams
from tidal.envs import EnvConfig, EnvRollout
from tidal.envs.tool_calls import format_tool_call
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import FunctionTool

from tests.envs.helpers import char_ids, chat_row


class BatchRandomEngine:
    """Samples like an engine with one random stream per call: the k-th completion of a call draws
    the k-th number of ``Random(params.seed)``, so a trajectory's turn depends on its call's batch."""

    def __init__(self, tok):
        self.tok, self.eos = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.batches: list[int] = []

    def generate(self, prompts, params: SamplingParams):
        rng = random.Random(params.seed)
        self.batches.append(len(prompts) * params.n)
        out = []
        for p in prompts:
            for _ in range(params.n):
                turn = self.tok.decode(p).count("<|im_start|>assistant") - 1
                x = rng.randint(1, 9)
                text = format_tool_call("calculator", {"expression": f"{x}*{x}"}) if turn < 2 else f"{x}"
                ids = char_ids(self.tok, text) + [self.eos]
                out.append(Completion(prompt_ids=list(p), token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


class JitteryCalculator(ToolEnv):
    """A calculator whose answers take a random 0-30 ms (an unseeded source: different every run)."""

    def make_tools(self):
        def calculator(expression: str) -> str:
            time.sleep(random.SystemRandom().uniform(0.0, 0.03))
            a, b = expression.split("*")
            return str(int(a) * int(b))

        return [FunctionTool(calculator, name="calculator", description="multiply",
                             parameters={"type": "object", "properties": {"expression": {"type": "string"}}})]


def _run(tok, cfg):
    engine = BatchRandomEngine(tok)
    rows = [chat_row(tok, f"Question {i}", where=f"t.jsonl:{i}") for i in range(4)]
    result = EnvRollout(cfg, tok, env_factory=lambda: JitteryCalculator(cfg)).run(
        engine.generate, rows, SamplingParams(max_new_tokens=64, n=2, seed=7))
    return [(t.rows[0].input_ids, t.rows[0].action_mask, t.finish_reason) for t in result.trajectories], engine.batches


def test_lockstep_rollouts_are_the_same_for_the_same_seed(qwen25_tok):
    cfg = EnvConfig(name="calculator", lockstep=True, workers=8)
    runs = [_run(qwen25_tok, cfg) for _ in range(3)]
    assert runs[0][0] == runs[1][0] == runs[2][0]
    assert runs[0][1] == [8, 8, 8]  # each round decodes every trajectory: one call per turn

