"""Preference pairs from the data layer: every row convention, chat templates, the separator, bad
rows (identical, missing fields) as errors naming file and line or counted skips, the overlong
rules, every file format, and blending -- with ids equal to what the reward component scores."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.test_data_loaders import write_hf_disk
from tidal.config_base import ConfigError, build
from tidal.data.config import DataConfig, DataSource
from tidal.rewards.model import encode_for_reward
from tidal.rm.config import RewardModelConfig
from tidal.rm.dataset import PreferenceDataset
from tidal.tasks.tokenizer import train_tokenizer

CORPUS = ["What is the sky colour? It is blue. It is green. Say hello. hello hi 0123456789 system be brief"] * 4
SYS = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "What colour is the sky?"}


def A(text):
    return [{"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=320)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return DataSource(path=str(path))


def make(tmp_path, tok, rows, data=None, **rm):
    source = write_jsonl(tmp_path / "pairs.jsonl", rows)
    return PreferenceDataset([source], tok, build(DataConfig, data or {}), build(RewardModelConfig, rm), seed=0)


def decoded(tok, ds, i=0):
    p = ds[i]
    return tok.decode(p.chosen_ids), tok.decode(p.rejected_ids)


def templated(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_explicit_string_prompt_is_templated_and_ids_match_the_reward_component(tmp_path, tok):
    ds = make(tmp_path, tok, [{"prompt": "Say hello.", "chosen": "hello", "rejected": "hi"}], separator=" ")
    prompt = templated(tok, [{"role": "user", "content": "Say hello."}])
    assert prompt.startswith("<bos><|user|>Say hello.") and prompt.endswith("<|assistant|>")
    assert decoded(tok, ds) == (prompt + " hello", prompt + " hi")
    # exactly the ids a `type: model` reward component computes for RewardSample(prompt, response)
    assert ds[0].chosen_ids == encode_for_reward(tok, [prompt + " " + "hello"], max_length=4096)[0]
    assert ds[0].where.endswith("pairs.jsonl:1")


@pytest.mark.parametrize("row", [
    {"messages": [SYS, USER], "chosen": A("It is blue."), "rejected": A("It is green.")},  # messages + assistant lists
    {"prompt": [SYS, USER], "chosen": A("It is blue."), "rejected": A("It is green.")},  # TRL: prompt as a chat
    {"messages": [SYS, USER], "chosen": "It is blue.", "rejected": "It is green."},  # messages + strings
    {"chosen": [SYS, USER, *A("It is blue.")], "rejected": [SYS, USER, *A("It is green.")]},  # implicit prompt
    {"prompt": USER["content"], "chosen": [SYS, USER, *A("It is blue.")], "rejected": [SYS, USER, *A("It is green.")]},  # UltraFeedback
], ids=["messages", "trl_prompt_chat", "messages_strings", "implicit", "ultrafeedback"])
def test_every_convention_gives_the_same_texts(tmp_path, tok, row):
    ds = make(tmp_path, tok, [row])
    prompt = templated(tok, [SYS, USER])
    assert decoded(tok, ds) == (prompt + "It is blue.", prompt + "It is green.")


def test_implicit_string_pairs_are_scored_as_given(tmp_path, tok):
    ds = make(tmp_path, tok, [{"chosen": "The sky is blue.", "rejected": "The sky is green."}], separator="|")
    assert decoded(tok, ds) == ("The sky is blue.", "The sky is green.")


def test_system_prompt_and_raw_prompts(tmp_path, tok):
    ds = make(tmp_path, tok, [{"prompt": "Say hello.", "chosen": "hello", "rejected": "hi"}], data={"system_prompt": "be brief"})
    prompt = templated(tok, [SYS, {"role": "user", "content": "Say hello."}])
    assert decoded(tok, ds)[0] == prompt + "hello"
    raw = make(tmp_path, tok, [{"prompt": "Say hello.", "chosen": "hello", "rejected": "hi"}],
               data={"apply_chat_template": False}, separator="\n")
    assert decoded(tok, raw) == ("Say hello.\nhello", "Say hello.\nhi")


def test_custom_field_names(tmp_path, tok):
    ds = make(tmp_path, tok, [{"q": "Say hello.", "good": "hello", "bad": "hi"}],
              data={"prompt_key": "q"}, chosen_key="good", rejected_key="bad")
    assert decoded(tok, ds)[1].endswith("<|assistant|>hi")


BAD_ROWS = [
    ("identical", {"prompt": "Say hello.", "chosen": "hello", "rejected": "hello"}, "are the same response"),
    ("identical", {"chosen": [USER, *A("hi")], "rejected": [USER, *A("hi")]}, "are the same conversation"),
    ("malformed", {"prompt": "Say hello.", "chosen": "hello"}, "'rejected' is missing"),
    ("malformed", {"prompt": "Say hello.", "chosen": "", "rejected": "hi"}, "'chosen' is missing or empty"),
    ("malformed", {"chosen": "hello", "rejected": "hi", "prompt": 3}, "'prompt' must be a string"),
    ("malformed", {"prompt": "Say hello.", "chosen": 5, "rejected": "hi"}, "'chosen' must be a string or a list"),
    ("malformed", {"prompt": "x", "chosen": [USER, *A("a")], "rejected": "b"}, "holding one assistant message"),
    ("malformed", {"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "must be an assistant message"),
    ("malformed", {"chosen": [USER, *A("a")], "rejected": [SYS, *A("b")]}, "share no first messages"),
    ("malformed", {"chosen": [USER, *A("a"), USER], "rejected": [USER, *A("b")]}, "exactly one assistant reply"),
    ("malformed", {"chosen": "a", "rejected": [USER, *A("b")]}, "both be strings or both be conversations"),
    ("malformed", {"prompt": "x", "messages": [USER], "chosen": "a", "rejected": "b"}, "exactly one of"),
    ("malformed", {"prompt": "other", "chosen": [USER, *A("a")], "rejected": [USER, *A("b")]}, "prompt field differs"),
]


@pytest.mark.parametrize("kind,row,message", BAD_ROWS, ids=[m for _, _, m in BAD_ROWS])
def test_bad_row_is_an_error_naming_file_and_line(tmp_path, tok, kind, row, message):
    good = {"prompt": "Say hello.", "chosen": "hello", "rejected": "hi"}
    with pytest.raises(ValueError) as info:
        make(tmp_path, tok, [good, "", row])  # a blank line still counts: the bad row is line 3
    text = str(info.value)
    assert "pairs.jsonl:3:" in text and message in text and "reward_model.bad_pairs=skip" in text


def test_bad_rows_are_skipped_and_counted(tmp_path, tok):
    good = {"prompt": "Say hello.", "chosen": "hello", "rejected": "hi"}
    ds = make(tmp_path, tok, [good] + [row for _, row, _ in BAD_ROWS] + [good], bad_pairs="skip")
    assert ds.num_pairs == len(ds) == 2
    assert ds.skipped == {"identical": 2, "malformed": len(BAD_ROWS) - 2}
    assert "2 skipped as identical (first: " in ds.summary() and "pairs.jsonl:2:" in ds.first_skip["identical"]


def test_a_source_with_no_usable_pair_is_an_error(tmp_path, tok):
    with pytest.raises(ValueError, match="no usable preference pairs .*skipped as identical"):
        make(tmp_path, tok, [{"prompt": "x", "chosen": "a", "rejected": "a"}], bad_pairs="skip")


def test_overlong_rules(tmp_path, tok):
    short = {"prompt": "Say hello.", "chosen": "hello", "rejected": "hi"}
    long = {"prompt": "What is the sky colour? " * 8, "chosen": "It is blue.", "rejected": "It is green."}
    n_long = len(encode_for_reward(tok, [templated(tok, [{"role": "user", "content": long["prompt"]}]) + "It is green."], max_length=None)[0])
    limit = 20
    assert n_long > limit
    with pytest.raises(ValueError, match=rf"pairs.jsonl:2: .*{n_long} tokens > reward_model.max_length=20"):
        make(tmp_path, tok, [short, long], max_length=limit)
    dropped = make(tmp_path, tok, [short, long], max_length=limit, overlong="drop")
    assert dropped.num_pairs == 1 and dropped.num_dropped == 1
    cut = make(tmp_path, tok, [short, long], max_length=limit, overlong="left_truncate")
    assert cut.num_pairs == 2 and cut.num_truncated == 1
    pair = cut[1]
    full = templated(tok, [{"role": "user", "content": long["prompt"]}])
    assert pair.rejected_ids == encode_for_reward(tok, [full + "It is green."], max_length=limit)[0]  # as the component cuts
    assert len(pair.rejected_ids) == limit and tok.decode(pair.rejected_ids).endswith("<|assistant|>It is green.")


def test_replies_equal_after_truncation_count_as_identical(tmp_path, tok):
    row = {"chosen": "hello hello hello 123", "rejected": "hi hi hi hi 123"}
    with pytest.raises(ValueError, match="same tokens after truncation"):
        make(tmp_path, tok, [row], max_length=2, overlong="left_truncate")


def test_formats_and_blending(tmp_path, tok):
    rows = [{"prompt": f"Say {i}", "chosen": str(i), "rejected": str(i + 1)} for i in range(4)]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    folder = write_hf_disk(tmp_path / "disk", rows)
    data, rm = build(DataConfig, {}), build(RewardModelConfig, {})
    for source in (DataSource(path=str(js)), DataSource(path=str(tmp_path / "p.parquet")), DataSource(path=str(folder))):
        ds = PreferenceDataset([source], tok, data, rm, seed=0)
        assert [tok.decode(ds[i].chosen_ids)[-1] for i in range(4)] == ["0", "1", "2", "3"], source
    blended = PreferenceDataset([DataSource(path=str(js), weight=2.0), DataSource(path=str(folder), weight=0.5)], tok, data, rm, seed=0)
    assert blended.num_pairs == 8 and len(blended) == 8 + 2
    with pytest.raises(ValueError, match=r"p.parquet row 1: 'chosen' is missing"):
        pq.write_table(pa.Table.from_pylist([rows[0], {"prompt": "x", "chosen": None, "rejected": "y"}]), tmp_path / "p.parquet")
        PreferenceDataset([DataSource(path=str(tmp_path / "p.parquet"))], tok, data, rm, seed=0)


def test_missing_chat_template_is_a_config_error(tmp_path, tok):
    bare = train_tokenizer(CORPUS, vocab_size=320)
    bare.chat_template = None
    with pytest.raises(ConfigError) as info:
        make(tmp_path, bare, [{"prompt": "x", "chosen": "a", "rejected": "b"}])
    assert info.value.key == "data.apply_chat_template"
