"""verifiers (the extra ``verifiers``; run by .ci/run in the extras venv): its training client
(``verifiers.v1`` ``TrainClient``: the chat template rendered by ``renderers``, then vLLM's
``POST /inference/v1/generate``) against Tidal's engine behind :mod:`tidal.engine.generate_endpoint`.
The tokens its traces carry (prompt ids, completion ids and logprobs) are the engine's, bit for
bit, and the rows the trainer would train on from them pass the shared exact-token check."""

import asyncio
import threading
from pathlib import Path

import pytest

from tests.ecosystem import import_extra

import_extra("verifiers.v1", "verifiers")
pytestmark = pytest.mark.extras

from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.engine.generate_endpoint import GenerateEndpoint  # noqa: E402
from tidal.envs import EnvRow, TrajectoryBuilder  # noqa: E402
from tidal.envs.rollout import RolloutResult  # noqa: E402

from tests.ecosystem.exact import Recorder, assert_trained_equals_sampled, assert_trainer_logprobs_equal_engine  # noqa: E402

QUESTIONS = ["What is 2+3?", "Name a colour.", "Count to three.", "2+3?"]


def run_client(endpoint, tokenizer_dir: str, conversations: list[list[dict]], **sampling):
    """verifiers' TrainClient answering each conversation's next assistant turn, in a thread of
    its own (as the verifiers stack runs beside the trainer); returns its Responses."""
    out: dict = {}

    def main():
        from renderers import DefaultRendererConfig
        from verifiers.v1 import SamplingConfig, TrainClientConfig
        from verifiers.v1.clients.train import TrainClient
        from verifiers.v1.dialects import ChatDialect

        async def answer_all():
            client = TrainClient(TrainClientConfig(base_url=f"{endpoint.url}/v1", api_key_var="TIDAL_TEST_NO_KEY",
                                                   renderer=DefaultRendererConfig(), renderer_model_name=tokenizer_dir))
            try:
                return await asyncio.gather(*[client.get_response(ChatDialect(), {"model": "tiny", "messages": messages},
                                                                  SamplingConfig(**sampling)) for messages in conversations])
            finally:
                await client.close()

        try:
            out["responses"] = asyncio.run(answer_all())
        except BaseException as e:  # noqa: BLE001 -- raised in the test's thread
            out["error"] = e

    thread = threading.Thread(target=main)
    thread.start()
    return thread, out


def serve_until_answered(endpoint, generate, params, tokenizer_dir, conversations, **sampling):
    thread, out = run_client(endpoint, tokenizer_dir, conversations, **sampling)
    endpoint.serve(generate, params, until=lambda: not thread.is_alive())
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["responses"]


@pytest.fixture(scope="module")
def tiny(qwen25_tok, tmp_path_factory):
    from tests.engine.helpers import engine_for, tiny_hf

    tok_dir = tmp_path_factory.mktemp("tok")
    qwen25_tok.save_pretrained(tok_dir)
    model = tiny_hf("qwen2", vocab_size=len(qwen25_tok), max_position_embeddings=512)
    engine = engine_for(model, kv_cache_max_tokens=4096)
    endpoint = GenerateEndpoint(model="tiny", max_model_len=512)
    yield qwen25_tok, str(tok_dir), model, engine, endpoint
    endpoint.close()


@pytest.mark.usefixtures("one_thread")
def test_train_client_traces_carry_the_engines_exact_tokens_over_two_turns(tiny):
    """Two turns of four conversations: every TurnTokens the client returns is a completion the
    engine made (same prompt ids, ids, float32 logprobs), and the trajectories built from the
    traces (turn 2's prompt extends turn 1's prompt and completion: the observation between) train
    on exactly the sampled tokens, with the trainer's logprobs equal to the engine's."""
    tok, tok_dir, model, engine, endpoint = tiny
    rec = Recorder(engine.generate)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
    first = [[{"role": "user", "content": q}] for q in QUESTIONS]
    turn1 = serve_until_answered(endpoint, rec.generate, params, tok_dir, first, temperature=1.0, max_tokens=12)
    second = [m + [{"role": "assistant", "content": r.message.content or ""}, {"role": "user", "content": "And then?"}]
              for m, r in zip(first, turn1)]
    turn2 = serve_until_answered(endpoint, rec.generate, params, tok_dir, second, temperature=1.0, max_tokens=12)
    assert len(rec.completions) == 8 and endpoint.served == rec.completions
    trajectories = []
    for i, (a, b) in enumerate(zip(turn1, turn2)):
        ta, tb = a.tokens, b.tokens
        builder = TrajectoryBuilder(list(ta.prompt_ids))
        builder.add_turn(list(ta.completion_ids), list(ta.completion_logprobs), "stop", a.message.content or "")
        context = list(ta.prompt_ids) + list(ta.completion_ids)
        if list(tb.prompt_ids[: len(context)]) == context:  # the rendered history extends the sampled tokens: append
            builder.add_observation(list(tb.prompt_ids[len(context):]), second[i][-1:])
        else:  # the template re-rendered the history: a row of its own (env.history: template)
            builder.new_row(list(tb.prompt_ids))
        builder.add_turn(list(tb.completion_ids), list(tb.completion_logprobs), "stop", b.message.content or "")
        trajectories.append(builder.finish(row=EnvRow(prompt_ids=list(ta.prompt_ids), prompt_text="", where=f"q:{i}"), group_id=i, finish_reason="done"))
    result = RolloutResult(trajectories=trajectories, metrics={})
    assert assert_trained_equals_sampled(result, rec.completions, tok.pad_token_id) == 8
    assert_trainer_logprobs_equal_engine(result, model, tok.pad_token_id)


@pytest.mark.usefixtures("one_thread")
def test_samples_asked_in_separate_rounds_are_drawn_independently(tiny):
    """The same prompt asked in two rounds (two generate calls, each its first sequence) under the
    run's seed: different draws (each call has a seed of its own), as the n samples of a group need."""
    tok, tok_dir, model, engine, endpoint = tiny
    rec = Recorder(engine.generate)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
    for _ in range(2):
        serve_until_answered(endpoint, rec.generate, params, tok_dir, [[{"role": "user", "content": "Count to three."}]],
                             temperature=1.0, max_tokens=12)
    first, second = rec.completions[-2:]
    assert first.prompt_ids == second.prompt_ids and first.token_ids != second.token_ids


def test_requests_the_run_cannot_serve_are_refused_with_the_reason(tiny):
    """Another sampling filter than the run's (the trainer scores with the run's), more tokens than
    rollout.max_new_tokens: HTTP 400 saying which, through verifiers' client as a ProviderError."""
    tok, tok_dir, model, engine, endpoint = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
    for sampling, said in (({"temperature": 0.7}, "temperature=0.7 differs from the run's 1.0"),
                           ({"max_tokens": 40}, "max_tokens=40 must be in [1, 12]")):
        with pytest.raises(Exception, match="400") as info:
            serve_until_answered(endpoint, engine.generate, params, tok_dir, [[{"role": "user", "content": "hi"}]], **sampling)
        assert said in str(info.value), info.value


@pytest.mark.slow
def test_a_verifiers_environment_trains_with_exact_tokens(tiny_task_overrides, tmp_path, monkeypatch):
    """`env.name: verifiers` with our own verifiers v1 environment (tests/ecosystem/vf_answer.py: a
    two-turn harness and a reward of its task) trains the tiny quickstart model for 3 steps: every
    completion verifiers' client got is trained exactly once with the engine's ids and logprobs
    (tests/ecosystem/exact.py), the trainer's logprobs match the engine's, and the reward is the
    verifiers trace's."""
    from tidal.build import build_trainer
    from tidal.config import load_config
    from tidal.distributed import shutdown
    from tidal.envs.adapters import verifiers as adapter

    seen: list = []
    real_run = adapter.VerifiersRollout.run

    def recording_run(self, generate, rows, params, **kw):
        rec = Recorder(adapter.engine_generate(generate))
        result = real_run(self, rec.generate, rows, params, **kw)
        seen.append((result, rec.completions))
        return result

    monkeypatch.setattr(adapter.VerifiersRollout, "run", recording_run)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # a verifiers taskset id is an importable top-level module
    cfg = load_config("quickstart", tiny_task_overrides + [
        "env.name=verifiers", "env.kwargs={taskset: vf_answer}", "env.max_turns=2",
        f"run.output_dir={tmp_path}", "run.steps=3", "checkpoint.at_end=false", "train.old_logprobs=recompute",
        "reward.components.correct.path=tests.ecosystem.test_verifiers:no_reward"])
    trainer = build_trainer(cfg)
    try:
        metrics = [trainer.train_step(step) for step in (1, 2, 3)]
        pad = trainer.models.tokenizer.pad_token_id
    finally:
        shutdown()
    assert len(seen) == 3
    for result, completions in seen:
        assert len(result.trajectories) == cfg.rollout.prompts_per_step * cfg.rollout.n_samples
        assert all(len(t.turns) == 2 and t.valid for t in result.trajectories)  # the harness's two turns
        assert assert_trained_equals_sampled(result, completions, pad) == 2 * len(result.trajectories)
    for m in metrics:
        assert m["env/turns_mean"] == 2.0 and m["env/errors"] == 0.0
        assert m["reward/mean"] == pytest.approx(m["env/verifiers_reward_mean"])  # the trace's reward (the run's own is 0)
        assert m["mismatch/abs_logp_diff_mean"] < 1e-4, m  # the trainer's logprobs of the trained tokens vs the engine's


def no_reward(sample) -> float:
    """The run's own reward component: 0, so a step's reward is the verifiers trace's."""
    return 0.0


@pytest.mark.parametrize("kwargs, key", [
    ("{taskset: no_such_taskset_module}", "env.kwargs.taskset"),
    ("{taskset: vf_answer, renderer: {name: nope}}", "env.kwargs.renderer"),
    ("{}", "env.kwargs.taskset"),
])
def test_tidal_check_names_wrong_settings_in_one_line(kwargs, key, capsys, tmp_path, monkeypatch):
    from tidal.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setattr("tidal.tasks.assets._build", lambda *a, **k: pytest.fail("the task would build"))
    rc = main(["check", "quickstart", "env.name=verifiers", f"env.kwargs={kwargs}", f"task.workdir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f"'{key}'" in err, err
