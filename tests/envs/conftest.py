"""Tiny local tokenizers carrying the real Qwen2.5 / Qwen3 chat templates (tidal/envs/templates)."""

import pytest
import torch

from tidal.tasks.chatml import train_chatml_tokenizer

CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "Calculate 347*29 and tell me the result. The answer is 10063.",
    '{"name": "calculator", "arguments": {"expression": "347*29"}}',
    "Let me think about it step by step. print(2 + 2) Traceback error",
] * 10


@pytest.fixture(scope="session")
def qwen25_tok():
    return train_chatml_tokenizer(CORPUS, template="qwen2_5")


@pytest.fixture(scope="session")
def qwen3_tok():
    return train_chatml_tokenizer(CORPUS, template="qwen3")


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny engines: threads only add overhead and jitter)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
