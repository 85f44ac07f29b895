"""On-policy distillation on the quickstart task, on CPU: a weak student (its warm start ends on slipped
demonstrations) learns from a better teacher (clean warm start) with the teacher's reverse KL as the
only learning signal (``distill_task_weight`` 0: the task reward is evaluated, not trained on), and its held-out accuracy moves
measurably towards the teacher's."""

import json

import pytest

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.tasks import prepare
from tidal.tasks.config import TaskConfig

TASK = dict(name="arithmetic", digits=1, operations=["+"], num_train=70, num_eval=30, hidden_size=64,
            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, sft_batch_size=32, sft_lr=3e-3,
            sft_threads=2)  # the builds this test was measured on (a build's floats depend on its threads)


def _task_overrides(workdir, **kw) -> list[str]:
    settings = {**TASK, **kw, "workdir": str(workdir)}
    return [f"task.{k}={json.dumps(v)}" for k, v in settings.items()]


SEEDS = (1, 2, 3)  # the shipped run.seed and the next two: one 30-problem evaluation moves in steps of 1/30


def _distill(tmp_path, task_workdir, teacher, student_task, seed: int) -> tuple[float, float, list[dict]]:
    """One 120-step distillation run of the student at ``seed``: (start and end held-out accuracy, metric rows)."""
    out = tmp_path / f"run{seed}"
    cfg = load_config("quickstart", _task_overrides(task_workdir, **student_task) + [
        f"run.output_dir={out}", f"run.seed={seed}", "run.steps=120", "rollout.prompts_per_step=16", "rollout.n_samples=4",
        "rollout.max_new_tokens=4", "engine.kv_cache_max_tokens=2048", "optim.lr=5e-4",
        f"model.teacher.path={teacher.model_path}", "algorithm.distill_coef=1.0",
        "algorithm.distill_task_weight=0.0",  # the task reward is evaluated and logged, never trained on
        "eval.every=0", "checkpoint.at_end=false", "logging.backends=[jsonl]",
    ])
    trainer = build_trainer(cfg)
    try:
        assert trainer.models.teacher is not None
        final = trainer.fit()
    finally:
        shutdown()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return final["initial_eval/greedy_accuracy"], final["eval/greedy_accuracy"], [r for r in rows if r["step"] > 0]


@pytest.mark.slow
def test_student_moves_towards_a_better_teacher(tmp_path, task_workdir):
    teacher = prepare(TaskConfig(**TASK, workdir=str(task_workdir), sft_steps=600, sft_mistake_steps=0))
    student_task = dict(sft_steps=300, sft_mistake_steps=200, sft_mistake_rate=0.75)
    student = prepare(TaskConfig(**TASK, workdir=str(task_workdir), **student_task))
    assert teacher.sft_accuracy > student.sft_accuracy + 0.2, (teacher.sft_accuracy, student.sft_accuracy)
    for seed in SEEDS:
        start, end, rows = _distill(tmp_path, task_workdir, teacher, student_task, seed)
        assert start == pytest.approx(student.sft_accuracy)  # greedy: the same student whatever the seed
        kl_first = sum(r["distill/reverse_kl"] for r in rows[:5]) / 5
        kl_last = sum(r["distill/reverse_kl"] for r in rows[-5:]) / 5
        assert kl_last < kl_first, (seed, kl_first, kl_last)  # the student's samples look more like the teacher's
        assert end > start, (seed, start, end)
    # Each seed's student rises; three seeds, since one 30-problem evaluation moves in steps of 1/30 and which
    # problems flip depends on the sampling stream. Measured (issue 51 item 10), start 0.533, teacher 0.933:
    # seeds 1/2/3 end 0.600/0.733/0.633 with 2 threads, 0.633/0.733/0.767 with 1; the code before the sampler
    # changes (785fcfd, 1 thread) 0.733/0.733/0.800, and 0c04d04 0.767 at seed 1. The "half the gap" (0.733) that
    # seed 1 met before was that seed's draws (exactly 0.733), not a package: with today's packages 785fcfd meets it
    # and with the new sampling streams seed 2 does (seed 3 with 1 thread); the reverse KL falls as far at every seed
    # (to 0.15-0.25, 1 thread).
    # A bound on the mean over seeds is not set: 3 seeds x 2 thread counts do not separate the code's mean from noise.


def _remote_run(tmp_path, tiny_task_overrides, url, on_error):
    return load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={tmp_path / on_error}", "run.steps=1", "checkpoint.at_end=false", f"reward.on_error={on_error}",
        "algorithm.distill_coef=1.0", f"model.teacher.url={url}", "model.teacher.max_retries=0", "model.teacher.timeout_s=2",
    ])


def test_a_remote_teacher_scores_training_and_its_failures_follow_on_error(tmp_path, tiny_task_overrides, monkeypatch):
    """A live `tidal serve-teacher` app (the student's own model as teacher: reverse KL about 0) feeds a
    training step; when it fails every request, `on_error: drop` leaves the samples out and counts
    them, `raise` names the teacher and the sample."""
    import torch

    from tests.distill.test_distill_unit import _serve_in_thread
    from tidal.distill.server import TeacherScorer, build_app
    from tidal.models import load_causal_lm, load_tokenizer
    from tidal.models.loading import tokenizer_fingerprint
    from tidal.rewards.base import RewardError

    probe = load_config("quickstart", tiny_task_overrides)
    assets = prepare(probe.task)
    app = build_app(TeacherScorer(load_causal_lm(assets.model_path), torch.device("cpu")),
                    info={"tokenizer_sha256": tokenizer_fingerprint(load_tokenizer(assets.model_path))})
    url, stop = _serve_in_thread(app)
    try:
        trainer = build_trainer(_remote_run(tmp_path, tiny_task_overrides, url, "raise"))
        try:
            metrics = trainer.fit()
        finally:
            shutdown()
        assert abs(metrics["distill/reverse_kl"]) < 1e-3 and metrics["distill/teacher_dropped_count"] == 0
        trainer = build_trainer(_remote_run(tmp_path, tiny_task_overrides, url, "drop"))
        try:
            monkeypatch.setattr(trainer.models.remote_teacher, "url", "http://127.0.0.1:9")  # the endpoint goes down
            metrics = trainer.fit()
        finally:
            shutdown()
        assert metrics["distill/teacher_dropped_count"] == 16 and metrics["distill/teacher_failed_requests_count"] >= 1
        trainer = build_trainer(_remote_run(tmp_path, tiny_task_overrides, url, "raise"))
        try:
            monkeypatch.setattr(trainer.models.remote_teacher, "url", "http://127.0.0.1:9")
            with pytest.raises(RewardError, match="distillation teacher failed on sample 0"):
                trainer.fit()
        finally:
            shutdown()
    finally:
        stop()
