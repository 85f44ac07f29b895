"""PromptDataset: field mapping, chat templates, overlong handling, blending, errors naming file and line."""

import json
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tidal.config_base import ConfigError, build
from tidal.data import DataConfig, DataSource, PromptDataset

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["what is two plus two", "the answer is four", "hello world", "be brief", "system user assistant"]


def make_tokenizer(chat_template=CHAT_TEMPLATE, bos=False):
    """A byte-level BPE trained on a few sentences; special tokens of a Qwen-like chat format."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    if bos:
        from tokenizers.processors import TemplateProcessing

        tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg_for(paths, **kw):
    return build(DataConfig, {"train": [{"path": p} if isinstance(p, str) else p for p in paths], **kw})


def test_prompt_row_gets_template_and_generation_prompt(tmp_path):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "what is two plus two", "reference": "4", "label": "math", "id": 7}])
    cfg = cfg_for([path], system_prompt="be brief")
    item = PromptDataset(cfg.train, tok, cfg, seed=0)[0]
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is two plus two<|im_end|>\n<|im_start|>assistant\n"
    assert item.prompt_text == expected
    assert item.prompt_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.decode(item.prompt_ids) == expected
    assert (item.reference, item.label, item.metadata, item.images) == ("4", "math", {"id": 7}, None)
    assert (item.source, item.row) == (path, 0)


def test_messages_row_keeps_its_own_system_message(tmp_path):
    tok = make_tokenizer()
    msgs = [{"role": "system", "content": "own"}, {"role": "user", "content": "hello"}]
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": msgs, "images": "img.png"}])
    cfg = cfg_for([path], system_prompt="be brief")
    item = PromptDataset(cfg.train, tok, cfg, seed=0)[0]
    assert item.prompt_text == "<|im_start|>system\nown<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert item.images == ["img.png"] and item.label == "" and item.reference is None


def test_custom_field_names(tmp_path):
    tok = make_tokenizer()
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": "hello", "ans": [1, 2], "task": "t"}])
    cfg = cfg_for([path], prompt_key="q", reference_key="ans", label_key="task")
    item = PromptDataset(cfg.train, tok, cfg, seed=0)[0]
    assert item.reference == [1, 2] and item.label == "t" and item.metadata == {}


def test_raw_prompt_without_template_gets_tokenizer_special_tokens(tmp_path):
    tok = make_tokenizer(chat_template=None, bos=True)
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hello world"}])
    cfg = cfg_for([path], apply_chat_template=False)
    item = PromptDataset(cfg.train, tok, cfg, seed=0)[0]
    assert item.prompt_ids[0] == 3 and item.prompt_ids[1:] == tok("hello world", add_special_tokens=False)["input_ids"]
    assert item.prompt_text == "hello world"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hello"}])
    cfg = cfg_for([path])
    with pytest.raises(ConfigError, match="no chat template") as e:
        PromptDataset(cfg.train, make_tokenizer(chat_template=None), cfg, seed=0)
    assert e.value.key == "data.apply_chat_template" and "apply_chat_template=false" in str(e.value)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"reference": 1}, "exactly one of 'prompt' or 'messages', it has neither"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "it has both"),
        ({"prompt": 3}, "'prompt' must be a string"),
        ({"messages": [{"content": "no role"}]}, r"'messages'\[0\] must be an object"),
        ({"prompt": "a", "label": 5}, "'label' must be a string"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, bad, message):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n\n" + json.dumps(bad) + "\n")
    cfg = cfg_for([str(path)])
    with pytest.raises(ConfigError, match=message) as e:
        PromptDataset(cfg.train, make_tokenizer(), cfg, seed=0)
    assert e.value.message.startswith(f"{path}:3: ")  # blank line 2 is skipped but counted
    assert e.value.key.startswith("data.") and e.value.key.endswith("_key")  # the key whose field it is


def test_messages_without_template_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "b"}]}])
    cfg = cfg_for([path], apply_chat_template=False)
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: ") + ".*apply_chat_template is false"):
        PromptDataset(cfg.train, make_tokenizer(), cfg, seed=0)


def _overlong(tmp_path, mode, limit):
    rows = [{"prompt": "hello"}, {"prompt": "what is two plus two " * 6}, {"prompt": "be brief"}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    cfg = cfg_for([path], max_prompt_len=limit, overlong_prompt=mode)
    return path, cfg


def test_overlong_error_names_line(tmp_path):
    path, cfg = _overlong(tmp_path, "error", 20)
    with pytest.raises(ValueError, match=re.escape(f"{path}: 1 of its 3 rows have a prompt longer than data.max_prompt_len=20 tokens; "
                                                   f"the longest, {path}:2, has ") + r"(\d+): set data\.max_prompt_len=\1 to fit them"):
        PromptDataset(cfg.train, make_tokenizer(), cfg, seed=0)


def test_overlong_drop_counts(tmp_path):
    path, cfg = _overlong(tmp_path, "drop", 20)
    ds = PromptDataset(cfg.train, make_tokenizer(), cfg, seed=0)
    assert ds.num_dropped == 1 and len(ds) == 2 and ds.num_rows == 2
    assert [ds[i].row for i in range(2)] == [0, 2]


def test_left_truncate_keeps_generation_prompt(tmp_path):
    tok = make_tokenizer()
    path, cfg = _overlong(tmp_path, "left_truncate", 20)
    ds = PromptDataset(cfg.train, tok, cfg, seed=0)
    full = tok.apply_chat_template([{"role": "user", "content": "what is two plus two " * 6}], add_generation_prompt=True, tokenize=False)
    full_ids = tok(full, add_special_tokens=False)["input_ids"]
    item = ds[1]
    assert ds.num_truncated == 1 and ds.num_dropped == 0
    assert item.prompt_ids == full_ids[-20:]
    assert item.prompt_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert item.prompt_text == tok.decode(full_ids[-20:])


def test_left_truncate_limit_must_exceed_generation_prompt(tmp_path):
    path, cfg = _overlong(tmp_path, "left_truncate", 2)
    with pytest.raises(ConfigError, match="generation prompt") as e:
        PromptDataset(cfg.train, make_tokenizer(), cfg, seed=0)
    assert e.value.key == "data.max_prompt_len"


def test_blending_counts_and_determinism(tmp_path):
    tok = make_tokenizer()
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(4)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(10)])
    cfg = cfg_for([{"path": a, "weight": 2.5}, {"path": b, "weight": 0.3}])
    ds = PromptDataset(cfg.train, tok, cfg, seed=3)
    rows = [(ds[i].source, ds[i].row) for i in range(len(ds))]
    # a: round(2.5*4)=10 -> two full copies + 2 distinct rows; b: round(0.3*10)=3 distinct rows
    assert len(ds) == 13
    a_rows = [r for s, r in rows if s == a]
    b_rows = [r for s, r in rows if s == b]
    assert a_rows[:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert len(set(a_rows[8:])) == 2 and a_rows[8:] == sorted(a_rows[8:])
    assert len(set(b_rows)) == 3 and b_rows == sorted(b_rows)
    again = PromptDataset(cfg.train, tok, cfg, seed=3)
    assert [(again[i].source, again[i].row) for i in range(len(again))] == rows
    other = [tuple(PromptDataset(cfg.train, tok, cfg, seed=s)[i].row for i in range(8, 13)) for s in range(6)]
    assert len(set(other)) > 1  # the fractional draw depends on the seed


def test_source_that_contributes_nothing_is_an_error(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}])
    cfg = cfg_for([{"path": a, "weight": 0.2}])
    with pytest.raises(ValueError, match="contributes no prompts"):
        PromptDataset(cfg.train, make_tokenizer(), cfg, seed=0)


def test_no_sources_and_index_range(tmp_path):
    cfg = cfg_for([])
    with pytest.raises(ValueError, match="no data sources"):
        PromptDataset(cfg.train, make_tokenizer(), cfg, seed=0)
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}])
    ds = PromptDataset([DataSource(path=a)], make_tokenizer(), cfg, seed=0)
    with pytest.raises(IndexError):
        ds[1]


def test_metadata_is_a_copy(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "k": 1}])
    cfg = cfg_for([a])
    ds = PromptDataset(cfg.train, make_tokenizer(), cfg, seed=0)
    ds[0].metadata["k"] = 2
    assert ds[0].metadata == {"k": 1}
