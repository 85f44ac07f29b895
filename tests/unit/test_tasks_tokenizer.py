"""The locally trained tokenizer: digits one per token, exact round trips, chat template, reload."""

import pytest
from transformers import AutoTokenizer, Qwen2Config

from tidal.tasks.tokenizer import CHAT_TEMPLATE, ROLE_TOKENS, prompt_ids, save_tokenizer, train_tokenizer

CORPUS = [f"Calculate {a}+{b} {a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS)


def test_digits_are_single_tokens(tok):
    for number in ["0", "7", "122", "90817", "-48"]:
        pieces = tok.convert_ids_to_tokens(tok(number, add_special_tokens=False)["input_ids"])
        assert pieces == list(number)
    # every digit is its own vocabulary entry, so any number has as many tokens as characters
    assert all(tok.convert_tokens_to_ids(d) != tok.unk_token_id for d in "0123456789")


@pytest.mark.parametrize("text", ["Calculate 37+85", "122", " -48 \n", "héllo wörld 3.14!", ""])
def test_round_trip(tok, text):
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens_are_single_ids(tok):
    for t in [tok.bos_token, tok.eos_token, tok.pad_token] + ROLE_TOKENS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tok.unk_token_id
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert tok("37", add_special_tokens=True)["input_ids"] == tok("37", add_special_tokens=False)["input_ids"]


def test_chat_template(tok):
    chat = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Calculate 2+2"}]
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<bos><|system|>Be exact.<eos><|user|>Calculate 2+2<eos><|assistant|>"
    )
    assert tok.apply_chat_template(chat[1:], tokenize=False) == "<bos><|user|>Calculate 2+2<eos>"
    ids = prompt_ids(tok, "Calculate 2+2")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.decode(ids) == "<bos><|user|>Calculate 2+2<eos><|assistant|>"
    assert tok.decode(ids, skip_special_tokens=True) == "Calculate 2+2"


def test_reload_next_to_a_qwen2_config_is_identical(tok, tmp_path):
    # transformers 5 rebuilds the tokenizer of a qwen2 checkpoint as Qwen2Tokenizer from vocab+merges
    save_tokenizer(tok, str(tmp_path))
    Qwen2Config(vocab_size=len(tok), hidden_size=16, num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tok)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    for text in CORPUS[:20] + ["<bos><|user|>Calculate 37-85<eos><|assistant|>-48<eos>", "héllo 12\n"]:
        assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert prompt_ids(loaded, "Calculate 37+85") == prompt_ids(tok, "Calculate 37+85")
