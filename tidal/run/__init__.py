"""The run's reliability machinery, shared by every job: checkpoints (atomic, verified), the resume
point, the run directory and its lock, the watchdog, graceful stop on signals, and fault hooks."""
