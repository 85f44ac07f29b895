"""The ``tidal`` command: train, check, eval, export, serve-reward, report.

    tidal train CONFIG [key.sub=value ...]        # CONFIG: a shipped name (quickstart) or a YAML path
                                                   # its root key `job` picks what runs (rl, reward_model)
    tidal check CONFIG [overrides]                 # every check a run makes before loading, then its plan
    tidal eval [CONFIG] --checkpoint DIR [overrides]      # DIR's run config (RUN/config.yaml) by default
    tidal export [CONFIG] --checkpoint DIR --out OUT [overrides]
    tidal serve-reward ...                         # see `tidal serve-reward --help`
    tidal serve-teacher --model DIR ...            # a distillation teacher's token logprobs over HTTP
    tidal report RUN_DIR
    tidal launch [torchrun options] COMMAND ...    # several ranks: torchrun that keeps the exit codes

Run under ``tidal launch --nproc_per_node N`` (or ``torchrun --nproc_per_node N -m tidal.cli``) for
several ranks; every rank runs the same command.
"""

from __future__ import annotations

import argparse
import os
import sys

from tidal.config_base import ConfigError
from tidal.run.stop import EXIT_CODE as STOP_EXIT_CODE
from tidal.run.stop import StopRun
from tidal.run.run_lock import RunDirLost
from tidal.tasks.store import BuildStopped


def _load(args):
    """The config, validated, with its optional packages checked (before any process group or model),
    and third-party noise silenced for the run (:mod:`tidal.logging.quiet`)."""
    from tidal.config import load_config
    from tidal.logging.quiet import quiet_third_party
    from tidal.optional_deps import check_dependencies
    from tidal.tasks.reasoning_gym import check_sources

    cfg = load_config(args.config, args.overrides)
    check_dependencies(cfg)
    check_sources(cfg.data)  # reasoning-gym names and settings, by the library (imported only when used)
    quiet_third_party(int(os.environ.get("RANK", "0")))
    return cfg


def cmd_train(args) -> int:
    cfg = _load(args)
    if cfg.job != "rl":
        from tidal.jobs import run_job

        code = run_job(cfg, "train")
    else:
        from tidal.build import build_trainer
        from tidal.distributed import shutdown

        trainer = build_trainer(cfg)
        try:
            trainer.fit()
        finally:
            shutdown()
        code = 0
    if code == 0 and os.environ.get("RANK", "0") == "0":
        from tidal.run.run_dir import next_steps

        print("\n".join(next_steps(cfg, args.config, args.overrides)), flush=True)
    return code


def cmd_check(args) -> int:
    cfg = _load(args)  # before importing the checks (torch): a config error comes in a fraction of a second
    from tidal.check import check

    lines = check(cfg)  # on every rank: each checks its own device and paths
    if os.environ.get("RANK", "0") == "0":  # under torchrun / tidal launch, rank 0 says it once
        for line in lines:
            print(f"[tidal] {line}", flush=True)
        print("[tidal] check passed: the config, optional packages, device, ranks and paths are fine", flush=True)
    return 0


def run_config_path(checkpoint: str):
    """``R/config.yaml`` for a checkpoint ``R/checkpoints/step_N`` of run ``R`` (None elsewhere)."""
    from pathlib import Path

    path = Path(checkpoint)
    return path.parent.parent / "config.yaml" if path.parent.name == "checkpoints" else None


def _load_checkpoint_config(args):
    """eval/export's config: the run's own ``config.yaml`` beside the checkpoint, as the run resolved
    it (so its overrides need not be repeated), with this command's overrides; ``CONFIG`` only for a
    checkpoint without one. ``checkpoint.resume`` is the checkpoint. Returns (config, what it is)."""
    run_config = run_config_path(args.checkpoint)
    overrides = list(args.overrides) + [f"checkpoint.resume={args.checkpoint}"]
    if run_config is not None and run_config.is_file():
        args.config, source = str(run_config), f"the run's config {run_config}"
        overrides.append(f"run.output_dir={run_config.parent}")  # as the run wrote it, maybe relative to another cwd
    elif args.config:
        source = f"config {args.config}"
    else:
        raise ConfigError("--checkpoint", f"{args.checkpoint} has no run config beside it "
                          f"({run_config or 'not under a run directory'}); name the training config: "
                          f"tidal {args.command} CONFIG --checkpoint {args.checkpoint} [overrides]")
    args.overrides = overrides
    return _load(args), source


def cmd_eval(args) -> int:
    cfg, source = _load_checkpoint_config(args)
    if cfg.job != "rl":
        from tidal.jobs import run_job

        return run_job(cfg, "eval", checkpoint=args.checkpoint)
    from tidal.distributed import shutdown
    from tidal.build import build_checkpoint_policy

    policy = build_checkpoint_policy(cfg, evaluate=True)
    try:
        if policy.rt.is_main:
            print(f"[tidal] evaluating the actor of checkpoint {policy.path} (step {policy.step}; {source}) on "
                  f"{len(policy.eval_items)} eval prompts", flush=True)
        metrics = policy.evaluate()
        if policy.rt.is_main:
            import json

            print(json.dumps({"checkpoint": args.checkpoint, "step": policy.step, **metrics}))
    finally:
        shutdown()
    return 0


def check_out(cfg, args) -> None:
    """``--out`` may be written (:func:`tidal.trainer.export.check_export_target`): never the run
    directory, the checkpoint or ``model.path``; checked on every rank before anything loads."""
    from pathlib import Path

    from tidal.trainer.export import check_export_target

    checkpoint = Path(args.checkpoint)
    protected = {"the checkpoint": checkpoint}
    if checkpoint.parent.name == "checkpoints":  # a run's: its own checkpoints rotate there
        protected["the checkpoints folder"] = checkpoint.parent
    if cfg.model.path:
        protected["model.path"] = cfg.model.path
    check_export_target(args.out, run_dir=checkpoint.parent.parent, protected=protected)
    if Path(cfg.run.output_dir).resolve() != checkpoint.parent.parent.resolve():
        check_export_target(args.out, run_dir=cfg.run.output_dir)


def cmd_export(args) -> int:
    cfg, source = _load_checkpoint_config(args)
    check_out(cfg, args)
    if cfg.job != "rl":
        from tidal.jobs import run_job

        return run_job(cfg, "export", checkpoint=args.checkpoint, out=args.out, dtype=args.dtype)
    from tidal.distributed import shutdown
    from tidal.trainer.export import export_hf
    from tidal.build import build_checkpoint_policy

    policy = build_checkpoint_policy(cfg, evaluate=False)
    try:
        import torch

        dtype = getattr(torch, args.dtype) if args.dtype else policy.colocation.strategy.param_dtype
        what = f"checkpoint {policy.path} (step {policy.step})"
        out = export_hf(policy, args.out, dtype, source=what)
        if policy.rt.is_main:
            print(f"[tidal] exported the actor of {what} to {out} ({source}; a Hugging Face folder: weights in "
                  f"{str(dtype).removeprefix('torch.')}, config, tokenizer)", flush=True)
    finally:
        shutdown()
    return 0


def cmd_serve_reward(argv: list[str]) -> int:
    from tidal.rewards.server import main as serve_main

    return serve_main(argv)


def cmd_serve_teacher(argv: list[str]) -> int:
    from tidal.distill.server import main as serve_main

    return serve_main(argv)


def cmd_report(argv: list[str]) -> int:
    from tidal.report import main as report_main

    return report_main(argv)


def cmd_launch(argv: list[str]) -> int:
    from tidal.launch import main as launch_main

    return launch_main(argv)


def _end_process_group() -> None:
    """Destroy the process group a failed command started, if any (else NCCL warns at exit that
    ``destroy_process_group()`` was not called). A config error before torch loads has none."""
    if "torch" in sys.modules:
        from tidal.distributed.runtime import shutdown

        shutdown()


def shipped_configs() -> list[str]:
    """The names of the configs shipped in ``tidal/configs`` (``tidal train NAME``)."""
    from tidal.config import CONFIG_DIR

    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


TRAIN_EPILOG = """\
configs shipped with Tidal: {configs}

overrides: key.sub=value, any number, after the config (and before or after --checkpoint/--out for
eval and export); values are YAML: run.steps=10 rollout.temperature=0.7 logging.backends=[console,jsonl]
engine.backend=native. Every key is listed in the README's config table.

several ranks or GPUs: every rank runs the same command under torch's launcher, e.g.
  tidal launch --nproc_per_node 8 train my.yaml engine.tp_size=2
(torchrun's options, then the command; plain `torchrun --nproc_per_node 8 -m tidal.cli train ...` works
too, but torchrun ends every failure with exit code 1 and its own failure report)

exit codes: 0 done (only when the command finished: a process that ends early, even with code 0, is
named and exits 1), 2 config error (one line naming the key), {stop} stopped by SIGINT/SIGTERM/SIGHUP after a
saved step (or by Ctrl-C before training, e.g. in a task build, which keeps its finished phases)."""


CHECKPOINT_CONFIG_HELP = ("read only for a checkpoint without its run's config.yaml beside it: a checkpoint "
                          "RUN/checkpoints/step_N is loaded with RUN/config.yaml and the overrides given here")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="Colocated RL fine-tuning of language models.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run the config's job: RL training (job: rl) or reward-model training (job: reward_model)",
                       description="Run the config's job: RL training (job: rl) or reward-model training (job: reward_model).",
                       epilog=TRAIN_EPILOG.format(configs=", ".join(shipped_configs()), stop=STOP_EXIT_CODE),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", help="shipped config name (e.g. quickstart) or YAML path")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    c = sub.add_parser("check", help="validate a config, its optional packages, device, ranks and paths, print what the run will do; no training",
                       description="Every check `tidal train` makes before loading a model, then what the run will do "
                                   "(and the memory plan when a model folder is at hand). Nothing is trained or written.")
    c.add_argument("config", help="shipped config name (e.g. quickstart) or YAML path")
    c.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    e = sub.add_parser("eval", help="evaluate a checkpoint on the eval set")
    e.add_argument("config", nargs="?", help=CHECKPOINT_CONFIG_HELP)
    e.add_argument("--checkpoint", required=True)
    e.add_argument("overrides", nargs="*")
    x = sub.add_parser("export", help="write a Hugging Face folder from a checkpoint")
    x.add_argument("config", nargs="?", help=CHECKPOINT_CONFIG_HELP)
    x.add_argument("--checkpoint", required=True)
    x.add_argument("--out", required=True, help="a new or empty folder, or one an earlier export wrote (replaced)")
    x.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="the weights' dtype (default: the dtype the model trained in, strategy.param_dtype)")
    x.add_argument("overrides", nargs="*")
    sub.add_parser("serve-reward", help="serve a reward model or function over HTTP", add_help=False)
    sub.add_parser("serve-teacher", help="serve a distillation teacher's token logprobs over HTTP", add_help=False)
    sub.add_parser("report", help="draw a run's metric curves (PNG + HTML)", add_help=False)
    sub.add_parser("launch", help="run a command on several ranks (torchrun's options first), keeping Tidal's exit codes",
                   add_help=False)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The train/eval/export command line; ``key=value`` overrides may come anywhere after the config
    (argparse alone takes them only before ``--checkpoint``/``--out``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = list(args.overrides) + extra
    if getattr(args, "config", "") and "=" in args.config and args.command in ("eval", "export"):
        args.overrides.insert(0, args.config)  # `tidal eval --checkpoint DIR key=value`: no CONFIG
        args.config = None
    return args


def main(argv: list[str] | None = None) -> int:
    """The ``tidal`` command. As a program (``argv`` None) a train/check/eval/export runs in a child
    process that this one watches (:mod:`tidal.run.supervise`): whatever ends the child, the command
    says so and never exits 0 unless the command finished."""
    from tidal.run import supervise

    if argv is None and supervise.wanted(sys.argv[1:]):
        return supervise.run_supervised(sys.argv[1:])
    supervise.start_child()
    code = None
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
    finally:
        supervise.report_outcome(code)
    return code


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "serve-reward":
        return cmd_serve_reward(argv[1:])
    if argv and argv[0] == "serve-teacher":
        return cmd_serve_teacher(argv[1:])
    if argv and argv[0] == "report":
        return cmd_report(argv[1:])
    if argv and argv[0] == "launch":
        return cmd_launch(argv[1:])
    args = parse_args(argv)
    try:
        return {"train": cmd_train, "check": cmd_check, "eval": cmd_eval, "export": cmd_export}[args.command](args)
    except ConfigError as e:  # every rank finds the same error: rank 0 says it (RANK is set by torchrun)
        from tidal.launch import CONFIG_EXIT_CODE, record_error_file

        if os.environ.get("RANK", "0") == "0":
            print(f"tidal: {e}", file=sys.stderr)
        record_error_file(f"tidal: {e}")  # torchrun's failure report then names it
        _end_process_group()
        return CONFIG_EXIT_CODE
    except RunDirLost as e:  # said in one line: the traceback would only show the check
        print(f"tidal: {e}", file=sys.stderr)
        return 1
    except StopRun as e:  # a SIGINT/SIGTERM/SIGHUP stopped training after a step (and saved it)
        print(f"tidal: {e}", file=sys.stderr)
        return STOP_EXIT_CODE
    except (BuildStopped, KeyboardInterrupt) as e:  # Ctrl-C outside the training steps (a task build keeps its finished phases)
        print(f"tidal: {e if isinstance(e, BuildStopped) else 'stopped by SIGINT; rerun the same command to continue'}",
              file=sys.stderr)
        _end_process_group()
        return STOP_EXIT_CODE
    except Exception as e:
        if not _write_failed(e):
            raise
        print(f"tidal: {e}", file=sys.stderr)  # e.g. a full disk: one line, the earlier export or checkpoint kept
        _end_process_group()
        return 1


def _write_failed(exc: Exception) -> bool:
    """Whether ``exc`` is an export's failure (``tidal export``, or the reward-model job's export at
    the end) or a checkpoint save's (a full disk, a folder made read-only mid-run), whose message
    says in one line what failed and what is kept; without their module loaded, it cannot be one."""
    export, ckpt = sys.modules.get("tidal.trainer.export"), sys.modules.get("tidal.run.checkpoint")
    return (export is not None and isinstance(exc, export.ExportError)) or (
        ckpt is not None and isinstance(exc, ckpt.CheckpointSaveError))


if __name__ == "__main__":
    sys.exit(main())
