"""examples/gsm8k_tools/rollout.py runs end to end on the CPU with a tiny local model."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tidal.tasks.tokenizer import save_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _load_example():
    spec = importlib.util.spec_from_file_location("gsm8k_tools_rollout", ROOT / "examples/gsm8k_tools/rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
@pytest.mark.parametrize("engine", ["hf", "native"])
def test_rollout_example_writes_scored_trajectories(tmp_path, qwen25_tok, engine):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(qwen25_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         eos_token_id=qwen25_tok.eos_token_id, pad_token_id=qwen25_tok.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    save_tokenizer(qwen25_tok, str(tmp_path / "model"))
    data = tmp_path / "test.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 2?"}], "reference": str(i + 2), "label": "gsm8k"} for i in range(2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "traj.jsonl"
    rc = _load_example().main(["--model", str(tmp_path / "model"), "--data", str(data), "--rows", "2", "--n", "2",
                               "--max-tokens-per-turn", "8", "--max-turns", "2", "--engine", engine, "--device", "cpu",
                               "--kv-cache-max-tokens", "4096", "--out", str(out)])
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4 and all(line["reward"] in (0.0, 1.0) for line in lines)
    first = lines[0]["messages"]
    assert first[0]["role"] == "system" and "python tool" in first[0]["content"] and first[1]["content"] == "What is 0 + 2?"
    assert first[2]["role"] == "assistant"
