"""The tiny Qwen2.5-template tokenizer of tests/envs, for the adapters' token-in/token-out tests."""

from tests.envs.conftest import one_thread, qwen25_tok  # noqa: F401 -- fixtures shared with tests/envs
