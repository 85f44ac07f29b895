"""Bad input that used to reach a traceback: files that are not UTF-8 (config, JSONL, JSON), numbers
past their machine type (a timeout of inf, a seed of 2**70, 10**400 for a float), JSON that Python
cannot hold (integers of thousands of digits, nesting past the recursion limit), a prompt budget
past the model's positions. Each is an error naming the file and line/byte, or a ConfigError
naming the key -- found at load or setup time."""

import json

import pytest
from transformers import Qwen2Config, Qwen2VLConfig

from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.data.config import DataSource
from tidal.data.loaders import load_rows
from tidal.models.loading import check_context_fits


def test_config_file_that_is_not_utf8(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(b"run:\n  steps: 3\n  output_dir: caf\xe9\n")  # latin-1
    with pytest.raises(ConfigError) as info:
        load_config(str(cfg))
    assert info.value.key == "<config>"
    assert f"{cfg}:3: not UTF-8 text: byte 0xe9 at column 18 (byte offset 33)" in info.value.message


@pytest.mark.parametrize("name, data, message", [
    ("train.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', "train.jsonl:2: not UTF-8 text: byte 0xe9 at column 16"),
    ("train.json", b'[{"prompt": "a"},\n {"prompt": "\xff"}]', "train.json:2: not UTF-8 text: byte 0xff at column 14"),
    ("train.jsonl", b'{"prompt": "a", "reference": 1' + b"0" * 5000 + b"}\n", "train.jsonl:1: invalid JSON (ValueError: Exceeds the limit"),
    ("train.jsonl", b'{"prompt": "a", "reference": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "train.jsonl:1: invalid JSON (RecursionError"),
    ("train.json", b"[" * 100_000 + b"]" * 100_000, "train.json: invalid JSON (RecursionError"),
])
def test_data_file_that_python_cannot_read(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError) as info:
        load_rows(DataSource(path=str(path)))
    assert message in str(info.value) and str(tmp_path) in str(info.value), info.value


@pytest.mark.parametrize("key, value, message", [
    ("reward.components.correct.timeout_s", ".inf", "expected a finite number, got inf"),
    ("run.collective_timeout_s", "1e300", "longer than any duration Tidal takes"),
    ("run.collective_timeout_s", ".nan", "expected a finite number, got nan"),
    ("run.seed", str(2**70), "does not fit in a 64-bit integer"),
    ("run.seed", "-1", "must be >= 0"),
    ("optim.lr", "1" + "0" * 400, "is beyond the range of a float"),
    ("rollout.max_new_tokens", str(-(2**64)), "does not fit in a 64-bit integer"),
    ("algorithm.kl_clamp", "-.inf", "expected a finite number"),
])
def test_overflowing_values_are_config_errors_naming_the_key(key, value, message):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", [f"{key}={value}"])
    assert info.value.key == key and message in info.value.message, info.value


def test_every_float_and_int_key_rejects_values_past_its_type():
    """All numeric keys at once (not case by case): inf, nan and 2**70 are ConfigErrors at that key."""
    from tidal.config import config_reference_rows

    keys = [(k, t) for k, t, _ in config_reference_rows() if t in ("int", "float")]
    assert len(keys) > 60
    for key, tp in keys:
        for value in ([".inf", "-.inf", ".nan", str(2**70)] if tp == "float" else [str(2**70), str(-(2**70))]):
            try:
                load_config("quickstart", [f"{key}={value}"])
            except ConfigError as e:
                assert e.key == key, (key, value, e)
            else:
                if value != str(2**70):  # 2**70 is a fine float for most float keys
                    pytest.fail(f"{key}={value} was accepted")


def test_prompt_budget_past_the_models_positions():
    text = Qwen2Config(max_position_embeddings=64, num_hidden_layers=1)
    check_context_fits(text, max_prompt_len=48, max_new_tokens=16)  # exactly fits
    with pytest.raises(ConfigError) as info:
        check_context_fits(text, max_prompt_len=48, max_new_tokens=17)
    assert info.value.key == "rollout.max_new_tokens" and "= 65 exceeds the model's 64 positions" in info.value.message
    with pytest.raises(ConfigError) as info:
        check_context_fits(text, max_prompt_len=64, max_new_tokens=1)
    assert info.value.key == "data.max_prompt_len"
    vl = Qwen2VLConfig(text_config={"max_position_embeddings": 32, "num_hidden_layers": 1})  # positions live in its text config
    with pytest.raises(ConfigError, match="exceeds the model's 32 positions"):
        check_context_fits(vl, max_prompt_len=30, max_new_tokens=8)


def _word_tokenizer(folder, **special):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["one two three"], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **special).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))  # a model folder (its class adds no tokens)
    return folder


def test_tokenizer_without_pad_token(tmp_path):
    from tidal.models.loading import load_tokenizer

    tok = load_tokenizer(str(_word_tokenizer(tmp_path / "eos_only", eos_token="<eos>")))
    assert tok.pad_token == "<eos>" and tok.pad_token_id == tok.eos_token_id  # the documented choice
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(_word_tokenizer(tmp_path / "neither")))
    assert info.value.key == "model.tokenizer_path" and "neither a pad token nor an EOS token" in info.value.message


def test_tokenizer_ids_past_the_embedding(tmp_path):
    from tidal.models.loading import check_tokenizer_fits, load_tokenizer

    tok = load_tokenizer(str(_word_tokenizer(tmp_path / "t", eos_token="<eos>", pad_token="<pad>")))  # <pad>: a new token, id 5
    check_tokenizer_fits(tok, Qwen2Config(vocab_size=6, num_hidden_layers=1))
    with pytest.raises(ConfigError) as info:
        check_tokenizer_fits(tok, Qwen2Config(vocab_size=5, num_hidden_layers=1))
    assert info.value.key == "model.tokenizer_path" and "'<pad>' (id 5) have none" in info.value.message
