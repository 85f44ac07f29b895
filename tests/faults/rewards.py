"""Reward functions for fault tests: a deterministic varied one, and ones that misbehave on cue."""

import math
import zlib

CALLS = {"n": 0}


def text_hash_reward(sample) -> float:
    """A number in [0, 1) from the response text alone: every group has signal, runs are reproducible."""
    return (zlib.crc32(sample.response.encode()) % 1000) / 1000.0


def nan_from_third_step(sample) -> float:
    """NaN for every sample from the third call with sample index 0 on (a world of one, 4 prompts x 4
    samples a step: the third training step) -- a reward model that starts emitting NaN mid-run."""
    if sample.index == 0:
        CALLS["n"] += 1
    return math.nan if CALLS["n"] >= 3 else text_hash_reward(sample)


def nan_on_odd_index(sample) -> float:
    """NaN for odd sample indices: half the samples of every step are broken."""
    return math.nan if sample.index % 2 else text_hash_reward(sample)


def wrong_length_batched(samples) -> list[float]:
    """A batched function that drops the last score."""
    return [text_hash_reward(s) for s in samples[:-1]]


wrong_length_batched.batched = True


# ---- reward functions that misbehave as badly as Python allows (tests/faults/test_reward_faults.py) ----
def exits(sample) -> float:
    """sys.exit() on the sample whose response is 'exit' (a BaseException, not an Exception)."""
    import sys

    if sample.response == "exit":
        sys.exit(3)
    return 1.0


def interrupts(sample) -> float:
    if sample.response == "exit":
        raise KeyboardInterrupt("pressed ^C inside a reward")
    return 1.0


async def async_exits(sample) -> float:
    import sys

    if sample.response == "exit":
        sys.exit(4)
    return 1.0


def batched_exits(samples) -> list[float]:
    import sys

    if any(s.response == "exit" for s in samples):
        sys.exit(5)
    return [1.0] * len(samples)


batched_exits.batched = True


def hangs_forever(sample) -> float:
    """Never returns on 'hang' (a thread or process stuck in a C call, a deadlock)."""
    import time

    if sample.response == "hang":
        while True:
            time.sleep(0.05)
    return 1.0


async def blocks_the_loop(sample) -> float:
    """An async function that blocks its event loop (time.sleep instead of asyncio.sleep)."""
    import time

    if sample.response == "hang":
        time.sleep(8)
    return 1.0


def dies(sample) -> float:
    """Ends its process at once on 'die' (os._exit: no exception to catch anywhere)."""
    import os

    if sample.response == "die":
        os._exit(7)
    return 1.0


def pid(sample) -> float:
    import os

    return float(os.getpid())


def huge(sample) -> float:
    """1e39: finite in float64, inf in float32."""
    return 1e39 if sample.response == "huge" else 1.0


# ---- fuzzing (tests/faults/test_fuzz_properties.py): return whatever the test put here ----
FUZZ_VALUES: list = []


def fuzz_value(sample):
    return FUZZ_VALUES[sample.index]


def fuzz_batched(samples):
    return FUZZ_VALUES[0] if len(FUZZ_VALUES) == 1 else list(FUZZ_VALUES)


fuzz_batched.batched = True


def near_float32_max(sample) -> float:
    return 3e38


# ---- rewards that move or remove the run under it (tests/faults/test_silent_wrong_runs.py) ----
def chdir_away(sample) -> float:
    """os.chdir into $TIDAL_TEST_CHDIR (a reward that changes the process's directory)."""
    import os

    os.chdir(os.environ["TIDAL_TEST_CHDIR"])
    return text_hash_reward(sample)


def remove_run_dir_at_step_2(sample) -> float:
    """Remove $TIDAL_TEST_RUN_DIR while scoring the second step (a world of one: the second call
    with sample index 0)."""
    import os
    import shutil

    if sample.index == 0:
        CALLS["n"] += 1
        if CALLS["n"] == 2:
            shutil.rmtree(os.environ["TIDAL_TEST_RUN_DIR"])
    return text_hash_reward(sample)


def exits_cleanly(sample) -> float:
    """os._exit(0) on 'bye': ends its process as if it had finished (no exception, exit code 0)."""
    import os

    if sample.response == "bye":
        os._exit(0)
    return 1.0


def kills_itself(sample) -> float:
    """SIGKILL to its own process on 'die' (nothing in the process can stop it)."""
    import os
    import signal

    if sample.response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def hangs_a_while(sample) -> float:
    """Sleeps 3 s on 'hang' (past a short timeout_s; its thread ends by itself later)."""
    import time

    if sample.response == "hang":
        time.sleep(3)
    return 1.0


def forks_a_child(sample) -> float:
    """Runs a child through multiprocessing's fork: the child ends with os._exit(0) as it must."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join(30)
    return float(child.exitcode == 0)


# ---- ways out of a process that no exception handler sees (issue 44 item 3) ----
from os import _exit as _bound_exit  # noqa: E402 -- bound at import, as a user's module may: patching os._exit misses it


def posix_exits(sample) -> float:
    """posix._exit(0) on 'bye' (the function os._exit is bound to)."""
    import posix

    if sample.response == "bye":
        posix._exit(0)
    return 1.0


def bound_exits(sample) -> float:
    """An ``_exit`` bound at import, called with 0 on 'bye'."""
    if sample.response == "bye":
        _bound_exit(0)
    return 1.0


def ctypes_exits(sample) -> float:
    """libc's _exit(0) through ctypes on 'bye' (no Python function involved)."""
    import ctypes

    if sample.response == "bye":
        ctypes.CDLL(None)._exit(0)
    return 1.0


def posix_exits_at_step_2(sample) -> float:
    """posix._exit(0) while scoring the second step (a world of one: the second call with sample
    index 0): a trainer that ends mid-run with exit code 0 and no message."""
    import posix

    if sample.index == 0:
        CALLS["n"] += 1
        if CALLS["n"] == 2:
            posix._exit(0)
    return text_hash_reward(sample)


def slow(sample) -> float:
    """Text-hash reward after 0.2 s: steps long enough for a signal to land mid-run."""
    import time

    time.sleep(0.2)
    return text_hash_reward(sample)


def leaves_a_process(sample) -> float:
    """Starts, once per run directory, a process that sleeps 120 s, inherits stdout and is never
    stopped (a sandbox or server a reward forgets); its pid goes to ``$TIDAL_TEST_LEFTOVER``."""
    import os
    import subprocess
    import sys

    marker = os.environ["TIDAL_TEST_LEFTOVER"]
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid))
    return text_hash_reward(sample)


def checkpoints_read_only_at_step_2(sample) -> float:
    """Remount the tmpfs at $TIDAL_TEST_RO read-only while scoring the second step (a world of one:
    the second call with sample index 0)."""
    import os
    import subprocess

    if sample.index == 0:
        CALLS["n"] += 1
        if CALLS["n"] == 2:
            subprocess.run(["mount", "-o", "remount,ro", os.environ["TIDAL_TEST_RO"]], check=True)
    return text_hash_reward(sample)


def raises_50_mb(sample) -> float:
    """Raises with a 50 MB message (a whole log or response pasted into the error)."""
    raise ValueError("start " + "x" * 50_000_000 + " end")
