"""Root config: YAML + overrides, unknown keys and bad values named by their dotted key."""

import pytest

from tidal.algorithms import Algorithm
from tidal.config import TidalConfig, load_config
from tidal.config_base import ConfigError, apply_overrides, build, parse_override
from tidal.distributed.runtime import rollout_group_ranks

BASE = {
    "model": {"path": "/m"},
    "data": {"train": [{"path": "/d.jsonl"}]},
    "reward": {"components": {"c": {"type": "function", "path": "tidal.tasks.quickstart:arithmetic_reward"}}, "recipes": {"default": [["c", 1.0]]}},
}


def test_builds_and_round_trips():
    cfg = build(TidalConfig, BASE)
    assert cfg.model.path == "/m" and cfg.data.train[0].path == "/d.jsonl"
    again = build(TidalConfig, cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "override, key",
    [
        ("engine.tp_sise=2", "engine.tp_sise"),
        ("rollout.n_samples=0", "rollout.n_samples"),
        ("rollout.n_samples=two", "rollout.n_samples"),
        ("optim.lr=-1", "optim.lr"),
        ("engine.block_size=12", "engine.block_size"),
        ("algorithm.advantage=nope", "algorithm.advantage"),
        ("train.mini_batches=3", "train.mini_batches"),
        ("nosection.x=1", "nosection"),
        ("strategy.zero_stage=2", "strategy.zero_stage"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        build(TidalConfig, apply_overrides(BASE, [override]))
    assert e.value.key == key, str(e.value)


def test_world_checks():
    cfg = build(TidalConfig, apply_overrides(BASE, ["engine.tp_size=4", "rollout.prompts_per_step=8"]))
    with pytest.raises(ConfigError, match="WORLD_SIZE % engine.tp_size") as e:
        rollout_group_ranks(6, cfg.engine.tp_size)  # the one check of tp_size, where the groups are made
    assert e.value.key == "engine.tp_size"
    cfg.check_world(8)
    with pytest.raises(ConfigError) as e:
        cfg.check_world(16)  # 8 prompts over 16 ranks
    assert e.value.key == "rollout.prompts_per_step"


def test_task_excludes_model_path():
    with pytest.raises(ConfigError) as e:
        build(TidalConfig, apply_overrides(BASE, ["task.name=arithmetic"]))
    assert e.value.key == "model.path"
    with pytest.raises(ConfigError) as e:
        build(TidalConfig, {"data": BASE["data"]})
    assert e.value.key == "model.path"


def test_override_parsing():
    assert parse_override("a.b=1.5") == (["a", "b"], 1.5)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a=true") == (["a"], True)
    cfg = build(TidalConfig, apply_overrides(BASE, ["optim.lr=1e-3"]))  # YAML reads 1e-3 as a string
    assert cfg.optim.lr == 1e-3
    with pytest.raises(ConfigError):
        parse_override("novalue")
    with pytest.raises(ConfigError):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_shipped_quickstart_loads():
    cfg = load_config("quickstart", ["run.steps=2"])
    assert cfg.task.name == "arithmetic" and cfg.run.steps == 2
    with pytest.raises(ConfigError, match="shipped"):
        load_config("no_such_config")


@pytest.mark.parametrize("overrides, reuses", [
    ([], True),  # one optimizer step per rollout, KL off
    (["algorithm.kl_coef=0.05"], True),  # KL as a loss is computed in the update
    (["train.old_logprobs=recompute"], False),
    (["train.epochs=2"], False),
    (["train.mini_batches=2"], False),
    (["algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true"], False),  # the reward needs them first
])
def test_old_logprobs_pass_is_skipped_only_with_one_step_per_rollout(overrides, reuses):
    cfg = load_config("quickstart", overrides)
    assert Algorithm(cfg.algorithm).reuses_policy_logprobs(cfg.train) is reuses


@pytest.mark.parametrize("backend, field, value", [
    ("hf", "kv_cache_max_tokens", 4096), ("hf", "block_size", 32), ("hf", "max_num_batched_tokens", 1024),
    ("hf", "kv_cache_memory_fraction", 0.3), ("hf", "enable_prefix_caching", False), ("hf", "cuda_graphs", False),
    ("hf", "kernel_backend", "torch"), ("hf", "overlap_scheduling", False), ("hf", "tp_size", 2),
    ("vllm", "kernel_backend", "triton"), ("vllm", "overlap_scheduling", False),
    ("sglang", "kernel_backend", "torch"), ("sglang", "overlap_scheduling", False),
])
def test_engine_fields_a_backend_does_not_honour_are_refused(backend, field, value):
    with pytest.raises(ConfigError) as e:
        build(TidalConfig, apply_overrides(BASE, [f"engine.backend={backend}", f"engine.{field}={value}"]))
    assert e.value.key == f"engine.{field}" and backend in str(e.value)


@pytest.mark.parametrize("backend", ["native", "hf", "vllm", "sglang"])
def test_every_backend_takes_the_defaults_and_what_it_honours(backend):
    honoured = {"native": ["engine.kernel_backend=torch", "engine.block_size=32"], "hf": ["engine.max_num_seqs=8", "engine.sleep_level=2"],
                "vllm": ["engine.block_size=32", "engine.kv_cache_max_tokens=4096"], "sglang": ["engine.cuda_graphs=false"]}[backend]
    cfg = build(TidalConfig, apply_overrides(BASE, [f"engine.backend={backend}", *honoured]))
    assert cfg.engine.backend == backend


@pytest.mark.parametrize("override, key", [
    ("model.critic_path=/c", "model.critic_path"), ("optim.critic_lr=1e-4", "optim.critic_lr"),
    ("strategy.offload_critic=true", "strategy.offload_critic"), ("model.reference_path=/r", "model.reference_path"),
    ("strategy.offload_reference=false", "strategy.offload_reference"), ("strategy.offload_teacher=false", "strategy.offload_teacher"),
    ("logging.wandb_project=x", "logging.wandb_project"), ("task.digits=3", "task.digits"),
    ("eval.temperature=0.7", "eval.temperature"), ("algorithm.lam=0.9", "algorithm.lam"),
    ("algorithm.value_clip=0.5", "algorithm.value_clip"), ("algorithm.kl_estimator=k1", "algorithm.kl_estimator"),
    ("algorithm.kl_horizon_steps=5", "algorithm.kl_horizon_steps"), ("algorithm.mismatch.cap=3.0", "algorithm.mismatch.cap"),
    ("algorithm.dynamic_sampling.max_tries=5", "algorithm.dynamic_sampling.max_tries"),
    ("algorithm.overlong.penalty_factor=2.0", "algorithm.overlong.penalty_factor"),
])
def test_a_setting_this_run_never_reads_is_refused(override, key):
    with pytest.raises(ConfigError) as e:
        build(TidalConfig, apply_overrides(BASE, [override]))
    assert e.value.key == key, str(e.value)


def test_the_same_settings_are_taken_where_they_are_read():
    cfg = build(TidalConfig, apply_overrides(BASE, [
        "algorithm.advantage=gae", "algorithm.gamma=0.99", "algorithm.lam=0.9", "algorithm.value_clip=0.5", "optim.critic_lr=1e-4",
        "strategy.offload_critic=true", "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1", "strategy.offload_reference=false",
        "eval.n_samples=4", "eval.temperature=0.7", "algorithm.mismatch.mode=token_truncate", "algorithm.mismatch.cap=3.0",
    ]))
    assert cfg.algorithm.lam == 0.9 and cfg.eval.temperature == 0.7


def test_a_repeated_yaml_key_is_a_config_error_naming_the_key_and_both_lines(tmp_path, capsys):
    """Issue 44 item 9: YAML keeps the last of two equal keys silently (a whole ``rollout:`` block was
    dropped and ``tidal check`` passed): a config error naming the key and both lines, in a config
    file, nested, in a list, and in an override's value."""
    from tidal.cli import main
    from tidal.config_base import load_yaml

    path = tmp_path / "run.yaml"
    path.write_text("run:\n  steps: 3\nrollout:\n  n_samples: 4\ndata:\n  shuffle: true\nrollout:\n  temperature: 0.5\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tidal: config error at 'rollout': {path}:7: duplicate key 'rollout' (first at line 3); YAML would "
                   "silently keep only the last one: merge the two or remove one"), err
    with pytest.raises(ConfigError) as info:
        load_yaml("a:\n  - b: 1\n    c: 2\n    b: 3\n", "x.yaml")
    assert info.value.key == "a[0].b" and "x.yaml:4: duplicate key 'b' (first at line 2)" in info.value.message
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", ["rollout={temperature: 1.0, temperature: 0.5}"])
    assert info.value.key == "rollout.temperature" and "(first at line 1)" in info.value.message
    assert load_yaml("base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  x: 3\n", "m.yaml") == {"base": {"x": 1, "y": 2}, "use": {"x": 3, "y": 2}}


def _alias_bomb(levels: int, width: int = 9) -> str:
    """A "billion laughs" document: level k is a list of ``width`` aliases to level k-1."""
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * width)}]" for k in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", ["file", "override"])
def test_an_alias_bomb_is_refused_in_work_bounded_by_the_document(tmp_path, capsys, where):
    """Issue 51 item 1: nine levels of nine aliases (400 bytes, 387 million values expanded) made the
    duplicate-key check walk every expansion (past 120 s); it walks each node once, and a document
    whose aliases add more than MAX_ALIAS_VALUES values is a config error at the value that does,
    in a file and in a command-line override."""
    import time

    from tidal.cli import main
    from tidal.config_base import MAX_ALIAS_VALUES

    bomb = _alias_bomb(9)
    start = time.perf_counter()
    if where == "file":
        (path := tmp_path / "bomb.yaml").write_text(bomb)
        assert main(["check", str(path)]) == 2
    else:
        flow = "{" + ", ".join(bomb.strip().splitlines()) + "}"
        assert main(["check", "quickstart", f"env.kwargs={flow}"]) == 2
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "aliases expand this value to" in err and "alias bomb" in err, err
    assert f"at most {MAX_ALIAS_VALUES:,} values added by aliases" in err, err
    assert elapsed < 5, elapsed  # was > 120 s; the check is linear in the 90 nodes written


def test_aliases_that_share_a_value_are_taken():
    """Sharing is what aliases are for: a value used in several places (also a small fan-out) loads
    as plain YAML would, and a repeated key inside a shared mapping is still found, once."""
    from tidal.config_base import load_yaml

    text = _alias_bomb(3)  # 9**4 = 6,561 values: under the bound
    assert load_yaml(text, "t.yaml") == __import__("yaml").safe_load(text)
    with pytest.raises(ConfigError) as info:
        load_yaml("base: &b {x: 1, x: 2}\nuse: [*b, *b]\n", "d.yaml")
    assert info.value.key == "base.x" and "d.yaml:1: duplicate key 'x'" in info.value.message


@pytest.mark.parametrize("override, key", [
    ("run.name=&a [*a]", "run.name[0]"), ("run.name=&a {x: *a}", "run.name.x"),
    ("env.kwargs=&a {x: [1, *a]}", "env.kwargs.x[1]"), ("env.kwargs=&a {<<: *a}", "env.kwargs.<<"),
    ("run=&r {name: [*r]}", "run.name[0]"),
])
def test_a_recursive_alias_is_a_config_error_naming_the_key(override, key, capsys):
    """Issue 51 item 2: ``run.name=&a [*a]`` was a 1,000-frame RecursionError traceback; a config
    must be a tree, and an alias inside the value it names is one line naming the key (exit 2)."""
    from tidal.cli import main

    with pytest.raises(ConfigError) as info:
        load_config("quickstart", [override])
    assert info.value.key == key and "sits inside that value (a recursive structure)" in info.value.message, info.value
    assert main(["check", "quickstart", override]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_recursive_alias_in_a_config_file_is_a_config_error(tmp_path, capsys):
    from tidal.cli import main

    (path := tmp_path / "loop.yaml").write_text("run:\n  name: &a\n    - x\n    - *a\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tidal: config error at 'run.name[1]':") and f"{path}:2: an alias to the value anchored at line 2 sits inside" in err, err


@pytest.mark.parametrize("value, words", [
    ("[" * 150 + "]" * 150, "values nest more than 100 levels deep"),
    ("[" * 100_000, "values nest more than 100 levels deep"),  # refused as read: its scan is quadratic
    ("- " * 1000 + "x", "values nest deeper than the YAML parser can follow"),
    ("9" * 5000, "Exceeds the limit (4300 digits) for integer string conversion"),
])
def test_deep_nesting_and_huge_integers_are_config_errors(value, words):
    """Nesting past what Python's stack follows was a RecursionError traceback, an integer past
    Python's digit limit a ValueError traceback: both a config error at the override's key."""
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", [f"run.name={value}"])
    assert info.value.key.startswith("run.name") and words in info.value.message, info.value
    assert len(str(info.value)) < 2000
