"""The torch-free tokenizer of `tidal check` (tidal.data.tokenizer_file) renders and counts as the run's
transformers tokenizer of the same folder does; folders it cannot promise that for are left to transformers."""

import json

import pytest
from transformers import Qwen2Config

from tidal.data.check import sample_rows
from tidal.data.config import DataConfig, DataSource
from tidal.data.tokenizer_file import load_tokenizer_file
from tidal.models.loading import load_tokenizer
from tidal.tasks.chatml import train_chatml_tokenizer
from tidal.tasks.tokenizer import save_tokenizer, train_tokenizer

CORPUS = ["12*34? 408", "What is 7+8? 15", "Use the calculator tool. multiply(12, 34)"]
CHATS = [
    [{"role": "user", "content": "What is 12*34?"}],
    [{"role": "system", "content": "Use the calculator tool."}, {"role": "user", "content": "7 + 8 = ?  héllo\n\ttabs"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module", params=["quickstart", "qwen2_5", "qwen3"])
def folder(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(request.param)
    tok = train_tokenizer(CORPUS) if request.param == "quickstart" else train_chatml_tokenizer(CORPUS, template=request.param)
    save_tokenizer(tok, str(tmp_path))
    Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=1000).save_pretrained(tmp_path)  # a model folder, as a run's
    return str(tmp_path)


def test_renders_and_counts_as_transformers(folder):
    light, full = load_tokenizer_file(folder), load_tokenizer(folder)
    assert light is not None and light.chat_template == full.chat_template
    for chat in CHATS:
        for gen in (True, False):
            text = full.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert light.apply_chat_template(chat, add_generation_prompt=gen) == text
            for special in (True, False):
                assert light(text, add_special_tokens=special)["input_ids"] == full(text, add_special_tokens=special)["input_ids"]


@pytest.mark.parametrize("apply_chat_template", [True, False])
def test_sampled_rows_count_the_same_tokens(folder, tmp_path, apply_chat_template):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} * {i + 3}? " * (i + 1), "reference": "1"}) + "\n" for i in range(40)))
    cfg = DataConfig(apply_chat_template=apply_chat_template, system_prompt="Be brief." if apply_chat_template else None,
                     max_prompt_len=4096)
    counts = [[r.prompt_tokens for r in sample_rows(DataSource(path=str(rows)), cfg, tok, key="data.train[0]")]
              for tok in (load_tokenizer_file(folder), load_tokenizer(folder))]
    assert counts[0] == counts[1] and max(counts[0]) > 100


@pytest.mark.parametrize("change", ["no tokenizer.json", "vision processor", "add_bos_token", "named templates"])
def test_left_to_transformers(folder, change, tmp_path):
    """None where transformers' loading would give another tokenizer or template than the files say."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(folder, root)
    assert load_tokenizer_file(str(root)) is not None
    config = json.loads((root / "tokenizer_config.json").read_text())
    if change == "no tokenizer.json":
        (root / "tokenizer.json").unlink()
    elif change == "vision processor":
        (root / "preprocessor_config.json").write_text("{}")
    elif change == "add_bos_token":
        (root / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    else:
        (root / "chat_template.jinja").unlink(missing_ok=True)
        (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": [{"name": "default", "template": "x"}]}))
    assert load_tokenizer_file(str(root)) is None
