"""prepare(): builds once into a settings-keyed directory, atomically; SFT and greedy eval work."""

import json
import os

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from tidal.config_base import ConfigError
from tidal.tasks import TaskAssets, TaskConfig, prepare
from tidal.tasks import assets as prepare_module
from tidal.tasks.model import build_model
from tidal.tasks.sft import IGNORE, collate_masked, encode_sft_rows, evaluate_greedy, supervised_finetune
from tidal.tasks.store import asset_dir
from tidal.tasks.tokenizer import prompt_ids, train_tokenizer

TINY = dict(
    name="arithmetic", digits=1, operations=["+"], num_train=40, num_eval=10,
    hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
    sft_steps=2, sft_mistake_steps=2, sft_batch_size=4, sft_threads=1,
)  # fmt: skip


def _cfg(tmp_path, **kw):
    return TaskConfig(workdir=str(tmp_path), **{**TINY, **kw})


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_prepare_builds_loadable_assets(tmp_path):
    assets = prepare(_cfg(tmp_path))
    assert isinstance(assets, TaskAssets) and 0.0 <= assets.sft_accuracy <= 1.0
    train, held_out = _rows(assets.train_path), _rows(assets.eval_path)
    assert len(train) == 40 and len(held_out) == 10
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert all(r["label"] == "arithmetic" and str(eval(r["prompt"].split()[-1])) == r["reference"] for r in train)
    assert os.path.isfile(os.path.join(assets.model_path, "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(assets.model_path)
    model = Qwen2ForCausalLM.from_pretrained(assets.model_path)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.vocab_size == len(tok)
    assert evaluate_greedy(model, tok, held_out) == assets.sft_accuracy
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary directory left
    marker = json.loads(open(os.path.join(os.path.dirname(assets.model_path), "task.json")).read())
    assert marker["settings"]["sft_mistake_steps"] == 2 and marker["sft_accuracy"] == assets.sft_accuracy
    assert {"sft_loss", "clean_accuracy", "mistake_loss", "build_seconds"} <= set(marker)


def test_model_config_and_tokenizer_before_the_build_equal_the_builds(tmp_path):
    """`tidal check` makes the task model's config and tokenizer without building it: the same
    positions, vocabulary and token ids as the build's, which are read once the build exists."""
    made_config, made_tok = prepare_module.model_config_and_tokenizer(_cfg(tmp_path / "none"))
    assert not (tmp_path / "none").exists()
    prepare(_cfg(tmp_path))
    built_config, built_tok = prepare_module.model_config_and_tokenizer(_cfg(tmp_path))
    assert type(built_config) is type(made_config)
    for field in ("max_position_embeddings", "vocab_size", "hidden_size", "eos_token_id", "pad_token_id"):
        assert getattr(made_config, field) == getattr(built_config, field), field
    text = made_tok.apply_chat_template([{"role": "user", "content": "Calculate 3+4 and 12-7"}], tokenize=False, add_generation_prompt=True)
    assert made_tok(text)["input_ids"] == built_tok(text)["input_ids"] and len(made_tok) == len(built_tok)


def test_prepare_is_idempotent_and_keyed_by_settings(tmp_path, monkeypatch):
    first = prepare(_cfg(tmp_path))
    monkeypatch.setattr(prepare_module, "_build", lambda cfg, out, phases, run_threads: pytest.fail("rebuilt complete assets"))
    assert prepare(_cfg(tmp_path, sft_threads=2)) == first  # build speed is not a setting
    monkeypatch.undo()
    other = prepare(_cfg(tmp_path, seed=1))
    assert other.model_path != first.model_path
    assert _rows(other.train_path) != _rows(first.train_path)


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(cfg, out, phases, run_threads):
        (out / "train.jsonl").write_text("partial")
        raise RuntimeError("boom")

    monkeypatch.setattr(prepare_module, "_build", broken)
    with pytest.raises(RuntimeError):
        prepare(_cfg(tmp_path))
    assert os.listdir(tmp_path) == []


def test_prepare_rejects_no_task_and_foreign_dirs(tmp_path):
    with pytest.raises(ConfigError) as err:
        prepare(TaskConfig(workdir=str(tmp_path)))
    assert err.value.key == "name"
    cfg = _cfg(tmp_path)
    asset_dir(cfg, cfg.workdir).mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    assert err.value.key == "workdir"


def test_collate_masks_prompt_and_padding():
    input_ids, mask, labels = collate_masked([([5, 6, 7, 8], [0, 0, 1, 1]), ([5, 9, 3], [0, 1, 1])], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 3, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert labels.tolist() == [[IGNORE, IGNORE, 7, 8], [IGNORE, 9, 3, IGNORE]]


def test_sft_learns_a_few_rows_and_greedy_eval_scores_them():
    rows = [{"prompt": f"Calculate {a}+{b}", "reference": str(a + b), "label": "arithmetic"} for a, b in [(1, 2), (3, 4), (5, 0)]]
    tok = train_tokenizer(r["prompt"] for r in rows)
    (ids, n_prompt), *_ = encode_sft_rows(tok, rows)
    assert ids[:n_prompt] == prompt_ids(tok, rows[0]["prompt"]) and ids[n_prompt:] == [tok.convert_tokens_to_ids("3"), tok.eos_token_id]
    cfg = TaskConfig(name="arithmetic", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    torch.set_num_threads(1)
    model = build_model(cfg, tok)
    assert evaluate_greedy(model, tok, rows) == 0.0  # a random model does not answer
    losses = supervised_finetune(model, tok, rows, steps=150, lr=1e-2, batch_size=3, seed=0)
    assert losses[0] > 1.0 and losses[-1] < 0.1
    assert evaluate_greedy(model, tok, rows) == 1.0
    wrong = [dict(r, reference=str(int(r["reference"]) + 1)) for r in rows]
    assert evaluate_greedy(model, tok, wrong) == 0.0


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama", "gemma3", "olmo3"])
def test_task_architecture_builds_the_tiny_model_of_its_family(architecture):
    from tidal import families
    from tidal.tasks.architectures import TINY_SLIDING_WINDOW

    tok = train_tokenizer(["Calculate 1+2 3"])
    cfg = TaskConfig(name="arithmetic", architecture=architecture, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                     intermediate_size=64)
    model = build_model(cfg, tok, architecture=architecture)
    assert families.family_of(model.config).name == architecture and families.family_of(model.config).native
    caches = families.layer_caches(model.config)
    assert all(c.head_dim == 16 and c.kv_heads == 1 for c in caches)
    windowed = architecture in ("gemma3", "olmo3")
    assert [c.window for c in caches] == ([TINY_SLIDING_WINDOW] * 2 + [None] if windowed else [None] * 3)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.tie_word_embeddings
    with pytest.raises(ConfigError, match="architecture"):
        TaskConfig(name="arithmetic", architecture="gpt2")
