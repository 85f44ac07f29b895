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
