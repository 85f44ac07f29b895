"""Local reward model: a tiny random Qwen2 sequence classifier and a tokenizer trained here."""

import contextlib
import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

from tidal.config_base import ConfigError
from tidal.rewards import LocalPlacement, ModelPlacement, RewardConfig, RewardEngine, RewardSample

WORDS = "the answer is one two three four five six seven eight nine ten plus minus what <think> </think>".split()


def build_tokenizer(path):
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 2, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


def build_model(path, num_labels=1, pad_token_id=0, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=num_labels, pad_token_id=pad_token_id,
    )
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    build_tokenizer(root / "tok")
    build_model(root / "rm")
    build_model(root / "rm2", seed=1)
    return root


class CountingPlacement(LocalPlacement):
    def __init__(self, device):
        super().__init__(device)
        self.calls = []

    def prepare_frozen(self, model, *, resident):
        self.calls.append(("prepare", resident))
        return super().prepare_frozen(model, resident=resident)

    @contextlib.contextmanager
    def using(self, model):
        self.calls.append(("reload", model.config.name_or_path[-3:]))
        with super().using(model):
            yield model
        self.calls.append(("offload", model.config.name_or_path[-3:]))


def S(prompt, response, label=""):
    return RewardSample(prompt=prompt, response=response, prompt_ids=[], response_ids=[], label=label)


def reference_scores(rm_dirs, name, texts):
    """One sequence per forward pass, no padding: the ground truth micro-batching must reproduce."""
    tok = AutoTokenizer.from_pretrained(rm_dirs / "tok")
    model = Qwen2ForSequenceClassification.from_pretrained(rm_dirs / name).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([tok(t)["input_ids"]])).logits[0, 0].item() for t in texts]


def cfg_for(rm_dirs, components, recipes):
    return RewardConfig(components=components, recipes=recipes)


def model_spec(rm_dirs, name="rm", **kw):
    return {"type": "model", "path": str(rm_dirs / name), "tokenizer": str(rm_dirs / "tok"), "separator": " ", **kw}


def test_micro_batched_scores_match_one_by_one(rm_dirs):
    torch.set_num_threads(1)
    samples = [S("what is one plus two", "three"), S("what is ten", "the answer is ten ten ten"), S("six", "")]
    samples += [S("what is four minus one", "three three"), S("nine", "eight")]
    texts = [s.prompt + " " + s.response for s in samples]
    expected = reference_scores(rm_dirs, "rm", texts)
    assert len(set(round(e, 6) for e in expected)) == len(expected)  # a random model tells them apart
    cfg = cfg_for(rm_dirs, {"rm": model_spec(rm_dirs, micro_batch_size=2)}, {"default": [["rm", 2.0]]})
    out = RewardEngine(cfg, device=torch.device("cpu")).score(samples)
    assert out.components["rm"].tolist() == pytest.approx(expected, abs=1e-5)
    assert out.total_B.tolist() == pytest.approx([2 * e for e in expected], abs=1e-5)


def test_truncation_keeps_the_response_end(rm_dirs):
    long_prompt = " ".join(["what"] * 40)
    cfg = cfg_for(rm_dirs, {"rm": model_spec(rm_dirs, max_length=6)}, {"default": [["rm", 1.0]]})
    out = RewardEngine(cfg, device=torch.device("cpu")).score([S(long_prompt, "the answer is ten")])
    # 6 tokens kept from the left-truncated sequence: "what what the answer is ten"
    assert out.components["rm"].item() == pytest.approx(reference_scores(rm_dirs, "rm", ["what what the answer is ten"])[0], abs=1e-5)


def test_two_models_reload_and_offload_each_call_and_score_every_sample(rm_dirs):
    placement = CountingPlacement(torch.device("cpu"))
    assert isinstance(placement, ModelPlacement)
    cfg = cfg_for(
        rm_dirs,
        {"a": model_spec(rm_dirs, "rm"), "b": model_spec(rm_dirs, "rm2"), "fmt": {"type": "think_answer_format"}},
        {"default": [["a", 1.0]], "both": [["a", 0.5], ["b", 0.5]], "fmt": [["fmt", 1.0]]},
    )
    eng = RewardEngine(cfg, device=torch.device("cpu"), placement=placement)
    assert placement.calls == [("prepare", False), ("prepare", False)]
    placement.calls.clear()
    samples = [S("one", "two"), S("three", "four", label="both"), S("x", "y", label="fmt")]
    out = eng.score(samples)
    # each model is reloaded, runs, and is offloaded before the next one is reloaded
    assert placement.calls == [("reload", "/rm"), ("offload", "/rm"), ("reload", "rm2"), ("offload", "rm2")]
    a = reference_scores(rm_dirs, "rm", ["one two", "three four"])
    b = reference_scores(rm_dirs, "rm2", ["three four"])
    assert out.component_masks["a"].tolist() == [True, True, False]
    assert out.component_masks["b"].tolist() == [False, True, False]
    assert out.total_B.tolist() == pytest.approx([a[0], 0.5 * a[1] + 0.5 * b[0], 0.0], abs=1e-5)
    # a batch whose recipes use no model still runs both (same forward count on every rank)
    placement.calls.clear()
    eng.score([S("x", "y", label="fmt")])
    assert [c[0] for c in placement.calls] == ["reload", "offload", "reload", "offload"]


def test_unusable_models_are_config_errors(tmp_path, rm_dirs):
    build_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match="num_labels=1") as e:
        RewardEngine(cfg_for(rm_dirs, {"rm": {**model_spec(rm_dirs), "path": str(tmp_path / "two")}}, {"default": [["rm", 1]]}), device=torch.device("cpu"))
    assert e.value.key == "reward.components.rm.path"
    with pytest.raises(ConfigError, match="not a local model directory"):
        RewardEngine(cfg_for(rm_dirs, {"rm": {"type": "model", "path": str(tmp_path / "missing")}}, {"default": [["rm", 1]]}), device=torch.device("cpu"))


def test_non_finite_score_is_an_error(rm_dirs):
    cfg = RewardConfig(components={"rm": model_spec(rm_dirs)}, recipes={"default": [["rm", 1.0]]}, on_error="drop")
    eng = RewardEngine(cfg, device=torch.device("cpu"))
    with torch.no_grad():
        eng.components["rm"].model.score.weight.fill_(math.inf)
    out = eng.score([S("one", "two")])
    assert out.valid_B.tolist() == [False] and out.metrics["reward/rm/errors_count"] == 1.0


def test_separator_recorded_by_reward_model_training_is_used(rm_dirs, tmp_path):
    import json
    import shutil

    from tidal.config_base import ConfigError
    from tidal.rewards.model import FORMAT_FILE

    trained = tmp_path / "trained"
    shutil.copytree(rm_dirs / "rm", trained)
    (trained / FORMAT_FILE).write_text(json.dumps({"version": 1, "separator": " "}))
    samples = [S("what is one", "the answer is one")]
    expected = reference_scores(rm_dirs, "rm", ["what is one the answer is one"])
    for separator in ({}, {"separator": " "}):  # unset: the recorded one; set: must agree
        spec = {"type": "model", "path": str(trained), "tokenizer": str(rm_dirs / "tok"), **separator}
        out = RewardEngine(cfg_for(rm_dirs, {"rm": spec}, {"default": [["rm", 1.0]]}), device=torch.device("cpu")).score(samples)
        assert out.total_B.tolist() == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ConfigError) as info:
        RewardEngine(cfg_for(rm_dirs, {"rm": {**spec, "separator": ""}}, {"default": [["rm", 1.0]]}), device=torch.device("cpu"))
    assert info.value.key == "reward.components.rm.separator" and FORMAT_FILE in info.value.message
    # without a record an unset separator is empty
    spec = {"type": "model", "path": str(rm_dirs / "rm"), "tokenizer": str(rm_dirs / "tok")}
    out = RewardEngine(cfg_for(rm_dirs, {"rm": spec}, {"default": [["rm", 1.0]]}), device=torch.device("cpu")).score(samples)
    assert out.total_B.tolist() == pytest.approx(reference_scores(rm_dirs, "rm", ["what is onethe answer is one"]), abs=1e-5)
