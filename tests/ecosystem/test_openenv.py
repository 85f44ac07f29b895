"""OpenEnv (the extra ``openenv``; run by .ci/run in the extras venv): an in-process OpenEnv
environment mapped to turns, its rewards per turn and at the end, the trained tokens exactly the
sampled ones."""

import pytest

from tests.ecosystem import import_extra

import_extra("openenv", "openenv")
pytestmark = pytest.mark.extras

from tidal.config_base import ConfigError  # noqa: E402
from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.envs import EnvConfig, EnvRollout, make_env_factory  # noqa: E402

from tests.ecosystem.exact import Recorder, assert_trained_equals_sampled  # noqa: E402
from tests.envs.helpers import ScriptedEngine, chat_row  # noqa: E402

GUESS = "tests.ecosystem.openenv_guess:GuessEnv"


def policy(text: str, turn: int) -> str:
    """Sampled one character per token (tests/envs/helpers.py): words the tokenizer merges, so a
    re-encoded turn would differ from the sampled ids."""
    return ["The answer is 50", "The answer is 20", "The answer is 7"][turn]


def test_in_process_environment_rollout_is_exact(qwen25_tok):
    tok = qwen25_tok
    cfg = EnvConfig(name="openenv", kwargs={"environment": GUESS}, max_turns=5)
    engine = ScriptedEngine(tok, policy)
    rec = Recorder(engine.generate)
    rows = [chat_row(tok, "Play.", where="r:0")]
    result = EnvRollout(cfg, tok, env_factory=make_env_factory(cfg)).run(rec.generate, rows, SamplingParams(max_new_tokens=32, n=2))
    assert assert_trained_equals_sampled(result, rec.completions, tok.pad_token_id) == 6
    for traj in result.trajectories:
        assert [m["content"] for m in traj.messages] == ["Play.", "Guess my number (1-100).", "The answer is 50", "lower",
                                                     "The answer is 20", "lower", "The answer is 7"]
        assert traj.finish_reason == "done" and traj.outcome_reward == 1.0
        assert [t.reward for t in traj.turns] == pytest.approx([-0.1, -0.1, 0.0])  # per-turn rewards, then the outcome


def test_seed_from_the_row_and_settings_errors(qwen25_tok):
    cfg = EnvConfig(name="openenv", kwargs={"environment": GUESS, "role": "tool"})
    row = chat_row(qwen25_tok, "Play.")
    row.metadata["seed"] = 50
    env = make_env_factory(cfg)()
    env.reset(row)
    from tidal.envs import ModelTurn

    assert env.step(ModelTurn(token_ids=[1], text="50", finish_reason="stop", index=0)).done
    with pytest.raises(ConfigError, match="env.kwargs.environment"):
        make_env_factory(EnvConfig(name="openenv", kwargs={"environment": "tests.ecosystem.openenv_guess:Guess"}))
    with pytest.raises(ConfigError, match="env.kwargs.action_field"):
        make_env_factory(EnvConfig(name="openenv", kwargs={"environment": GUESS, "action_field": "text"}))
    with pytest.raises(ConfigError, match="env.kwargs.role"):
        make_env_factory(EnvConfig(name="openenv", kwargs={"environment": GUESS, "role": "system"}))


@pytest.mark.usefixtures("one_thread")
def test_tiny_model_on_the_native_engine(qwen25_tok):
    """A real tiny model sampling on the native engine against the OpenEnv environment (its random
    guesses get feedback until max_turns): trained ids, masks and logprobs are the engine's, and the
    trainer's log-probabilities equal the engine's on every sampled token."""
    from tests.ecosystem.exact import assert_trainer_logprobs_equal_engine
    from tests.engine.helpers import engine_for, tiny_hf

    tok = qwen25_tok
    model = tiny_hf("qwen2", vocab_size=len(tok), max_position_embeddings=512)
    engine = engine_for(model, kv_cache_max_tokens=4096)
    cfg = EnvConfig(name="openenv", kwargs={"environment": GUESS}, max_turns=3, max_tokens_per_turn=6)
    rec = Recorder(engine.generate)
    rows = [chat_row(tok, "Play.", where="r:0"), chat_row(tok, "Guess.", where="r:1")]
    result = EnvRollout(cfg, tok, env_factory=make_env_factory(cfg)).run(
        rec.generate, rows, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=0))
    assert any(len(t.turns) > 1 for t in result.trajectories)  # observations between sampled turns
    assert assert_trained_equals_sampled(result, rec.completions, tok.pad_token_id) == sum(len(t.turns) for t in result.trajectories)
    assert_trainer_logprobs_equal_engine(result, model, tok.pad_token_id)


def test_tidal_check_names_a_wrong_environment_in_one_line(capsys, tmp_path):
    from tidal.cli import main

    rc = main(["check", "quickstart", "env.name=openenv", "env.kwargs={environment: tests.ecosystem.openenv_guess:Nope}",
               f"task.workdir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "'env.kwargs.environment'" in err and "Nope" in err, err


@pytest.mark.parametrize("kwargs, key, said", [
    ("{environment: tests.ecosystem.openenv_guess:GuessEnv, environment_kwargs: {secret: 3, colour: red}}",
     "env.kwargs.environment_kwargs", "GuessEnv(**{'secret': 3, 'colour': 'red'}) failed: TypeError"),
    ("{environment: tests.ecosystem.openenv_guess:GuessEnv, environment_kwargs: [3]}", "env.kwargs.environment_kwargs",
     "must be a mapping"),
    ("{environment: tests.ecosystem.openenv_guess:GuessEnv, observation_field: text}", "env.kwargs.observation_field",
     "Feedback has no field 'text'; its fields: ['feedback']"),
])
def test_tidal_check_names_wrong_settings_in_one_line_before_any_step(kwargs, key, said, capsys, tmp_path, monkeypatch):
    """A constructor that refuses environment_kwargs and an observation_field the Observation class
    lacks: one line, exit 2, from `tidal check` (issue 47 item 6), nothing built or stepped."""
    from tidal.cli import main

    monkeypatch.setattr("tests.ecosystem.openenv_guess.GuessEnv.step", lambda *a, **k: pytest.fail("stepped"))
    rc = main(["check", "quickstart", "env.name=openenv", f"env.kwargs={kwargs}", f"task.workdir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f"'{key}'" in err and said in err, err
    assert not list(tmp_path.iterdir())  # the task is not built


def test_observation_field_found_from_resets_annotation():
    from tidal.envs.adapters.openenv import observation_class

    from tests.ecosystem.openenv_guess import Feedback, GuessEnv

    class Plain(GuessEnv.__mro__[1]):  # an Environment without generic arguments, annotated reset
        def reset(self, seed=None, episode_id=None, **kwargs) -> Feedback:
            return Feedback(feedback="")

    assert observation_class(GuessEnv) is Feedback and observation_class(Plain) is Feedback
