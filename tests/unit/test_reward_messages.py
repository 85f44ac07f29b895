"""RewardSample.messages: the whole conversation of a multi-turn trajectory reaches reward
functions (locally and through the remote protocol); single-turn samples are unchanged."""

import json

import pytest
import torch

from tidal.rewards import RewardConfig, RewardEngine, RewardSample
from tidal.rewards.protocol import ProtocolError, decode_request, encode_request

HERE = __name__
CONVERSATION = [
    {"role": "user", "content": "Calculate 347*29"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*29"}}\n</tool_call>'},
    {"role": "tool", "content": "10063"},
    {"role": "assistant", "content": "10063"},
]


def used_the_tool(sample):
    """1 when the conversation has a tool message, 0 otherwise (reads messages, not response)."""
    return float(any(m["role"] == "tool" for m in sample.messages or []))


def _sample(messages=None):
    return RewardSample(prompt="p", response="10063", prompt_ids=[1], response_ids=[2], messages=messages)


def test_reward_functions_receive_the_conversation():
    cfg = RewardConfig(components={"tool": {"type": "function", "path": f"{HERE}:used_the_tool"}}, recipes={"default": [["tool", 1.0]]})
    out = RewardEngine(cfg, device=torch.device("cpu")).score([_sample(CONVERSATION), _sample(None)])
    assert out.total_B.tolist() == [1.0, 0.0]


def test_protocol_carries_messages_and_omits_them_for_single_turn():
    body = json.loads(encode_request([_sample(CONVERSATION), _sample(None)]))
    assert body["samples"][0]["messages"] == CONVERSATION and "messages" not in body["samples"][1]
    back = decode_request(encode_request([_sample(CONVERSATION), _sample(None)]))
    assert back[0].messages == CONVERSATION and back[1].messages is None


@pytest.mark.parametrize("messages, match", [("hi", "messages must be a JSON list"), ([{"content": "x"}], r"messages\[0\]")])
def test_protocol_rejects_malformed_messages(messages, match):
    body = json.dumps({"samples": [{"prompt": "p", "response": "r", "messages": messages}]}).encode()
    with pytest.raises(ProtocolError, match=match):
        decode_request(body)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_huge_error_message_is_cut_where_it_is_made(isolation):
    """Issue 51 item 8: a 50 MB error message was printed whole (a 52 MB log line) and held once per
    failed sample (2.9 GB peak under ``drop``): it is cut to its start and end where the call ran."""
    from tidal.rewards.base import MAX_ERROR_CHARS, RewardError

    cfg = RewardConfig(components={"big": {"type": "function", "path": "tests.faults.rewards:raises_50_mb",
                                           "isolation": isolation}}, recipes={"default": [["big", 1.0]]})
    engine = RewardEngine(cfg, device=torch.device("cpu"))
    try:
        with pytest.raises(RewardError) as info:
            engine.score([_sample(), _sample()])
    finally:
        engine.close()
    text = str(info.value)
    assert len(text) < MAX_ERROR_CHARS + 300, len(text)
    assert "raised ValueError: start xxx" in text and "characters cut ...]" in text and text.endswith("xxx end (1 more samples failed)")
