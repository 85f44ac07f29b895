"""Config fuzzing: every key of the config reference and the shipped quickstart config set to
wrong types, negative/huge numbers, bogus enum values; unknown keys; sections replaced by scalars;
YAML that is not a tree or not small (recursive aliases, alias bombs, deep nesting, huge integers);
and a seeded random mix of several mutations at once -- through ``load_config`` overrides (the CLI
path) and ``TidalConfig.check_world``. A mutation either gives a valid config or a ConfigError (a
ValueError) naming a mutated key, never another exception type."""

import json
import random

import pytest
import yaml

from tidal.config import CONFIG_DIR, config_reference_rows, load_config
from tidal.config_base import ConfigError
from tidal.distributed.runtime import rollout_group_ranks

BASE = yaml.safe_load((CONFIG_DIR / "quickstart.yaml").read_text())
VALUES = ["bogus", "", -1, 0, -1e9, 2.5, 10**12, True, None, [1], [[1, 2]], {"x": 1}]
_BOMB = "{" + ", ".join(["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
    f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 9)}]" for k in range(1, 10)]) + "}"
RAW = ["&a [*a]", "&a {x: *a}", "&a {<<: *a}", "&a [1, [2, *a]]", _BOMB, "[" * 150 + "]" * 150,
       "[" * 3000 + "]" * 3000, "- " * 1000 + "x", "9" * 5000]  # value texts as typed on the command line (issue 51 items 1-2)
EXTRA_KEYS = [  # keys of the shipped config under free-form mappings (not in the reference table)
    "reward.components.correct", "reward.components.correct.type", "reward.components.correct.path",
    "reward.components.correct.timeout_s", "reward.recipes.arithmetic", "reward.recipes", "reward.components",
]
KEYS = [k for k, _, _ in config_reference_rows()] + EXTRA_KEYS
SECTIONS = sorted({k.split(".")[0] for k in KEYS})
UNKNOWN = ["bogus", "run.bogus", "run.stpes", "algorithm.dynamic_sampling.bogus", "model.lora.bogus",
           "reward.components.correct.bogus", "reward.bogus", "checkpoint.evry", "logging.backend"]


def override(key: str, value) -> str:
    return f"{key}={json.dumps(value)}"  # JSON is YAML: the CLI parses the value the same way


def mutation(key: str, rng: random.Random) -> str:
    return f"{key}={rng.choice(RAW)}" if rng.random() < 0.2 else override(key, rng.choice(VALUES))


def names_key(e: ConfigError, key: str) -> bool:
    """The error is at ``key`` (or inside it), or its message names ``key`` -- for a cross-field
    check, the partner field of the same section by its name."""
    if e.key == key or e.key.startswith((key + ".", key + "[")) or key in str(e):
        return True
    section, _, leaf = key.rpartition(".")
    return bool(section) and e.key.startswith(section + ".") and leaf in e.message


def outcome(overrides: list[str], keys: list[str]) -> str | None:
    """None when the config is valid or fails naming one of ``keys``; else what went wrong."""
    try:
        cfg = load_config("quickstart", overrides)
        for world in (1, 2, 4):
            rollout_group_ranks(world, cfg.engine.tp_size)
            cfg.check_world(world)
    except ConfigError as e:
        return None if any(names_key(e, k) for k in keys) else f"{overrides}: error names another key: {e}"
    except Exception as e:  # noqa: BLE001 -- exactly what must not happen
        return f"{overrides}: {type(e).__name__}: {e}"
    return None


def test_every_key_with_every_bad_value():
    failures = [f for key in KEYS for v in VALUES if (f := outcome([override(key, v)], [key]))]
    assert not failures, "\n".join(failures[:20])


def test_every_key_with_yaml_that_is_not_a_small_tree():
    """Issue 51 item 2: 71 of 1,500 fuzz cases with recursive aliases were RecursionError tracebacks.
    The texts are refused as they are parsed, whatever the key's type: each key takes them in turn
    (every text lands on keys of every type), and the seeded mixes below draw them too."""
    failures = [f for i, key in enumerate(KEYS) if (f := outcome([f"{key}={RAW[i % len(RAW)]}"], [key]))]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("key", UNKNOWN)
def test_unknown_key_is_named(key):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", [override(key, 1)])
    assert info.value.key == key and "unknown key" in info.value.message


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("value", [3, "x", [1, 2], None])
def test_section_replaced_by_a_value(section, value):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", [override(section, value)])
    assert info.value.key == section, info.value


def test_seeded_random_mixes():
    rng = random.Random(11)
    failures = []
    for _ in range(400):
        keys = rng.sample(KEYS, rng.randint(2, 4))
        keys = [k for k in keys if not any(k != o and k.startswith(o + ".") for o in keys)]  # no key inside another
        overrides = [mutation(k, rng) for k in keys]
        if rng.random() < 0.2:
            unknown = rng.choice(UNKNOWN)
            overrides.append(override(unknown, 1))
            keys.append(unknown)
        if (f := outcome(overrides, keys)):
            failures.append(f)
    assert not failures, "\n".join(failures[:20])


def test_known_invalid_values_are_rejected():
    """Spot checks that the fuzz would flag if validation regressed (each must be a ConfigError at its key)."""
    for key, value in [("run.steps", 0), ("rollout.prompts_per_step", -1), ("optim.lr", -1e-3), ("engine.tp_size", 3),
                       ("train.mini_batches", 5), ("algorithm.advantage", "bogus"), ("data.overlong_prompt", "bogus"),
                       ("logging.backends", ["bogus"]), ("optim.betas", [0.9]), ("reward.on_error", "ignore")]:
        with pytest.raises(ConfigError) as info:
            cfg = load_config("quickstart", [override(key, value)])
            rollout_group_ranks(2, cfg.engine.tp_size)
            cfg.check_world(2)
        assert names_key(info.value, key), (key, info.value)
