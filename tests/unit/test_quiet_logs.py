"""Third-party noise is kept off a run's console (tidal.logging.quiet), and a config error after the
process group started ends it (no NCCL/gloo warning at exit)."""

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import torch.distributed as dist

from tidal import cli
from tidal.logging.quiet import quiet_third_party

ROOT = Path(__file__).resolve().parents[2]

NOISY = """
import sys
from tidal.logging.quiet import quiet_third_party
if sys.argv[1] == "quiet":
    quiet_third_party(0)
import deepspeed  # prints the accelerator it picked
from tests.engine.helpers import tiny_hf
from transformers import AutoModelForCausalLM
model = tiny_hf("qwen2")
model.save_pretrained(sys.argv[2], max_shard_size="20KB")  # several shards: a writing bar
AutoModelForCausalLM.from_pretrained(sys.argv[2])  # a loading bar
"""


def _stderr(mode: str, out: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-c", NOISY, mode, str(out)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stderr + res.stdout


def test_weight_bars_and_the_accelerator_line_are_silenced(tmp_path):
    loud = _stderr("loud", tmp_path / "a")
    assert "accelerator" in loud and "%|" in loud  # what this test removes is there without it
    quiet = _stderr("quiet", tmp_path / "b")
    assert "accelerator" not in quiet and "%|" not in quiet, quiet


def test_deprecations_only_on_rank_0(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # leave the bars of this process alone
    for rank, shown in ((0, 2), (1, 0)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet_third_party(rank)
            warnings.warn("old", DeprecationWarning)
            warnings.warn("older", FutureWarning)
            warnings.warn("a real problem", UserWarning)
        assert len(seen) == shown + 1 and str(seen[-1].message) == "a real problem"


def test_transformers_load_report_reaches_a_log_without_colour_codes(tmp_path):
    """Issue 44 item 15: rm_quickstart's log held the load report's raw ANSI codes (a causal LM
    loaded as a sequence classifier: its new score head)."""
    import logging

    from transformers import AutoModelForSequenceClassification

    from tests.engine.helpers import tiny_hf

    tiny_hf("qwen2").save_pretrained(tmp_path / "lm")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        quiet_third_party(0)
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=1)
    finally:
        root.removeHandler(handler)
    report = [m for m in said if "LOAD REPORT" in m]
    assert report and "score.weight" in report[0] and not [m for m in said if "\x1b[" in m], said


def test_a_config_error_ends_the_process_group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert cli.main(["train", "quickstart", "run.stepz=1"]) == 2
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
