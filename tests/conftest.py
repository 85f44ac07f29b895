"""Shared fixtures: one folder for every built-in task's assets, and tiny task configs (each
distinct task built once per test session)."""

import os

import pytest

import tidal  # noqa: F401  before anything loads torch: its OpenMP threads then sleep while they wait (tidal/__init__.py)

os.environ.setdefault("OMP_NUM_THREADS", "2")

TINY_TASK = [
    "task.name=arithmetic", "task.digits=1", "task.operations=[+]", "task.num_train=80", "task.num_eval=16",
    "task.hidden_size=32", "task.num_layers=1", "task.num_heads=2", "task.num_kv_heads=1",
    "task.intermediate_size=64", "task.sft_steps=30", "task.sft_batch_size=32",
    "task.sft_threads=2",  # the same assets whichever test builds them first (the floats of a build depend on its threads)
]


@pytest.fixture(scope="session")
def task_workdir(tmp_path_factory):
    """The ``task.workdir`` (and ``reward_model.task.workdir``) of every test that builds a task: a
    task's assets are keyed by its settings (tidal/tasks/store.py), so tests whose task settings are
    equal share one build, e.g. the shipped calculator of tests/e2e and tests/envs. Tests must not
    modify what they are given (copy it first)."""
    return tmp_path_factory.mktemp("tasks")


@pytest.fixture(scope="session")
def tiny_task_overrides(task_workdir):
    """Overrides for `tidal train quickstart` that make a seconds-long run on a tiny task."""
    return TINY_TASK + [
        f"task.workdir={task_workdir}", "rollout.prompts_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=4",
        "engine.kv_cache_max_tokens=1024", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
        "logging.backends=[jsonl]",
    ]

TINY_RM_TASK = [
    "reward_model.task.num_train=96", "reward_model.task.num_eval=32", "reward_model.task.max_digits=2",
    "reward_model.task.hidden_size=32", "reward_model.task.num_layers=1", "reward_model.task.num_heads=2",
    "reward_model.task.num_kv_heads=1", "reward_model.task.intermediate_size=64",
]


@pytest.fixture(scope="session")
def tiny_rm_overrides(task_workdir):
    """Overrides for `tidal train rm_quickstart` that make a seconds-long reward-model run."""
    return TINY_RM_TASK + [
        f"reward_model.task.workdir={task_workdir}", "reward_model.batch_pairs=8", "optim.lr=3e-3", "optim.warmup_steps=0",
        "eval.every=0", "checkpoint.every=0", "checkpoint.at_end=false", "logging.backends=[jsonl]",
    ]
