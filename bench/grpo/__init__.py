"""GRPO benchmarks on one GPU: Tidal against TRL's ``GRPOTrainer``, and the workload matrix.

Layout (each module owns one thing):

- :mod:`.shapes`: the model shapes (Qwen2.5 0.5B, 1.5B, 3B, 7B; two tiny ones for CPU) and their counts.
- :mod:`.workloads`: what one case generates and trains (:class:`~.workloads.Workload`), the matrix,
  and the ``natural`` length draws shared by every framework; a case may distil its student from a
  larger teacher of the same tokenizer (Tidal only).
- :mod:`.settings`: how a run measures (:class:`~.settings.RunSettings`: warm-up, timed steps, TRL's
  micro-batch and dtype).
- :mod:`.bounds`: the device ceilings measured in the run, and each phase's lower bound from bytes
  moved and FLOPs counting real tokens only; MFU.
- :mod:`.assets`: the model folders, tokenizer and prompts both frameworks load.
- :mod:`.rewards`: the reward both frameworks score with.
- :mod:`.observe`: the Tidal observer (a :class:`tidal.logging.PhaseObserver`): memory timeline,
  placement calls, each rollout's lengths.
- :mod:`.profile`: one profiled Tidal iteration, per phase.
- :mod:`.tidal_runner`, :mod:`.trl_runner`: one runner per framework (a worker subprocess each) and
  the summaries of their records.
- :mod:`.procs`: worker subprocesses with time limits, their record files; :mod:`.setup_worker`:
  the environment, model folders, prompts and ceilings; :mod:`.session`: the parent's run (deadline,
  setup, one worker per case and framework, a case's bounds).
- :mod:`.record`: printed figures and record files, stamped with run id, commit, device, settings.
- :mod:`.e2e` (Tidal against TRL on one shape) and :mod:`.matrix` (the shape matrix): the entry
  points, ``python -m bench.grpo e2e ...`` and ``python -m bench.grpo matrix ...``.

Nothing in the libraries is patched: Tidal is observed through ``trainer.timer.add_observer``, the
metrics ``train_step`` returns, ``trainer.colocation.engine.stats`` and, for natural lengths,
``trainer.maker.completion_budget``; TRL through a ``transformers.TrainerCallback`` and its
``rollout_func`` argument (see :mod:`.trl_runner`).
"""
