"""Distillation pieces with hand-computed values: the per-token signal and its mixing with task
advantages, the config rules, the tokenizer check, and the remote teacher (a real `tidal
serve-teacher` app on loopback) against the local model's logprobs, including its failures."""

import asyncio
import json
import threading

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tidal.algorithms import Algorithm, AlgorithmConfig
from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.distill import protocol
from tidal.distill.remote import RemoteTeacher
from tidal.distill.server import TeacherScorer, build_app
from tidal.models.config import TeacherConfig
from tidal.models.loading import check_same_tokenizer, tokenizer_fingerprint
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.rewards.protocol import ProtocolError
from tidal.rewards.server import serve


def test_distill_advantage_is_the_negative_reverse_kl_per_sampled_token():
    algo = Algorithm(AlgorithmConfig(distill_coef=0.5))
    student = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    teacher = torch.tensor([[0.0, -0.5, -3.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    assert algo.distill_advantage_BT(student, teacher, mask).tolist() == [[0.0, 0.25, -0.5, 0.0]]


@pytest.mark.parametrize("task_weight", [1.0, 0.0])
def test_advantages_mix_task_and_teacher(task_weight):
    algo = Algorithm(AlgorithmConfig(distill_coef=1.0, distill_task_weight=task_weight))
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    out = algo.advantages(
        total_B=torch.tensor([1.0, 0.0]), action_mask_BT=mask, group_ids_B=torch.tensor([0, 0]),
        truncated_B=torch.tensor([False, False]), old_logp_BT=None, ref_logp_BT=None, values_BT=None,
        student_logp_BT=torch.tensor([[0.0, -1.0, -1.0], [0.0, -2.0, 0.0]]),
        teacher_logp_BT=torch.tensor([[0.0, -1.5, -0.5], [0.0, -1.0, 0.0]]),
    )
    grpo = 1.0 / (2**0.5 / 2 + 1e-6) * 0.5  # (r - mean) / (std + eps) of rewards [1, 0]: +-0.7071
    task = torch.tensor([[0.0, grpo, grpo], [0.0, -grpo, 0.0]])
    distill = torch.tensor([[0.0, -0.5, 0.5], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(out.advantages_BT, task_weight * task + distill, rtol=1e-4, atol=1e-4)
    assert out.metrics["distill/reverse_kl"] == pytest.approx((0.5 - 0.5 - 1.0) / 3)


@pytest.mark.parametrize("overrides, key", [
    (["algorithm.distill_coef=1.0"], "algorithm.distill_coef"),
    (["model.teacher.path=/t"], "model.teacher.path"),
    (["algorithm.distill_task_weight=0.5"], "algorithm.distill_task_weight"),
    (["algorithm.distill_coef=1.0", "model.teacher.path=/t", "model.teacher.url=http://x"], "model.teacher.url"),
    (["algorithm.distill_coef=1.0", "model.teacher.url=ftp://x"], "model.teacher.url"),
    (["algorithm.distill_coef=1.0", "model.teacher.path=/t", "reward.components={}", "reward.recipes={}"], "eval"),
])
def test_config_rules_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", overrides)
    assert e.value.key == key, str(e.value)


def test_distillation_alone_needs_no_reward_when_nothing_evaluates():
    cfg = load_config("quickstart", ["algorithm.distill_coef=1.0", "model.teacher.path=/t", "reward.components={}",
                                     "reward.recipes={}", "eval.at_start=false", "eval.at_end=false", "eval.every=0"])
    assert cfg.algorithm.distill_coef == 1.0
    with pytest.raises(ConfigError, match="nothing to learn from"):
        load_config("quickstart", ["reward.components={}", "reward.recipes={}", "eval.at_start=false", "eval.at_end=false", "eval.every=0"])


def _tokenizer(extra=()):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "a", "b", "c", *extra])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def test_a_teacher_with_another_tokenizer_is_refused():
    student = _tokenizer()
    check_same_tokenizer(student, tokenizer_fingerprint(_tokenizer()), key="model.teacher.path")
    with pytest.raises(ConfigError, match="teacher's tokenizer differs") as e:
        check_same_tokenizer(student, tokenizer_fingerprint(_tokenizer(["d"])), key="model.teacher.path")
    assert e.value.key == "model.teacher.path"


# ---- the remote teacher against a real server on loopback --------------------------------------------
def _tiny_lm():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    attach_logprob_method(model)
    return model


def _serve_in_thread(app):
    """Serve ``app`` on 127.0.0.1 (a free port) from a thread: (base URL, stop())."""
    box, ready = {}, threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve(app, "127.0.0.1", 0, ready=lambda p: (box.update(port=p), ready.set()), stop=stop))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)

    def close():
        loop.call_soon_threadsafe(stop.set)
        t.join(5)

    return f"http://127.0.0.1:{box['port']}", close


@pytest.fixture
def server():
    """A starter of loopback servers (stopped after the test) returning the base URL."""
    stops = []

    def start(app):
        url, stop = _serve_in_thread(app)
        stops.append(stop)
        return url

    yield start
    for stop in stops:
        stop()


def test_remote_teacher_equals_the_local_model(server):
    model = _tiny_lm()
    url = server(build_app(TeacherScorer(model, torch.device("cpu"), micro_batch_tokens=16), info={"tokenizer_sha256": "x"}))
    teacher = RemoteTeacher(TeacherConfig(url=url, batch_size=2))
    assert teacher.info()["tokenizer_sha256"] == "x"
    prompts, responses = [[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11], [12]]
    got, errors, counters = teacher.token_logprobs(prompts, responses)
    assert errors == {} and counters["failed_requests"] == 0
    for p, r, lp in zip(prompts, responses, got):
        ids = torch.tensor([p + r])
        act = torch.zeros_like(ids)
        act[0, len(p):] = 1
        want = token_logprobs(model, ids, torch.ones_like(ids), positions_BT=act)[0][0, len(p):]
        assert lp == pytest.approx(want.tolist(), abs=1e-5)


def test_remote_teacher_failures_are_errors_never_zeros(server):
    down = RemoteTeacher(TeacherConfig(url="http://127.0.0.1:9", max_retries=1, timeout_s=2))
    lps, errors, counters = down.token_logprobs([[1]], [[2, 3]])
    assert lps == [None] and "failed after 2 attempts" in errors[0] and counters["failed_requests"] == 1
    with pytest.raises(ConfigError, match="cannot read") as e:
        down.info()
    assert e.value.key == "model.teacher.url"

    from aiohttp import web

    async def short(request):  # one logprob short for the response
        return web.Response(body=json.dumps({"api_version": 1, "logprobs": [[-1.0]], "errors": [None]}).encode())

    app = web.Application()
    app.router.add_post(protocol.LOGPROBS_PATH, short)
    bad = RemoteTeacher(TeacherConfig(url=server(app)))
    lps, errors, _ = bad.token_logprobs([[1]], [[2, 3]])
    assert lps == [None] and "1 logprobs for a response of 2 tokens" in errors[0]


def test_protocol_rejects_malformed_bodies():
    for body in [b"{", b"[]", b'{"sequences": [{"prompt_ids": [1]}]}', b'{"sequences": [{"prompt_ids": [], "response_ids": []}]}',
                 b'{"sequences": [{"prompt_ids": [1.5], "response_ids": []}]}']:
        with pytest.raises(ProtocolError):
            protocol.decode_request(body)
    with pytest.raises(ProtocolError, match="not a finite log-probability"):
        protocol.decode_response(b'{"api_version": 1, "logprobs": [[0.5]], "errors": [null]}', [1])
