"""`tidal check CONFIG [overrides]`: the run's checks before loading (config, optional packages,
device, ranks, paths, context), then its plan and memory plan; nothing trained or written."""

import pytest
from transformers import Qwen2Config

from tidal.cli import main
from tidal.tasks.tokenizer import save_tokenizer, train_tokenizer

GSM8K = """\
run: {{output_dir: {out}, steps: 200}}
model: {{path: {model}}}
data: {{train: [{{path: {train}}}], max_prompt_len: 512}}
rollout: {{prompts_per_step: 64, n_samples: 8, max_new_tokens: 512}}
reward: {{components: {{answer: {{type: math_answer}}}}, recipes: {{gsm8k: [[answer, 1.0]]}}}}
logging: {{backends: [console, jsonl]}}
"""


@pytest.fixture
def config(tmp_path):
    model = tmp_path / "model"
    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=1000, max_position_embeddings=2048).save_pretrained(model)
    save_tokenizer(train_tokenizer(["1+1? 2", "2+3? 5"]), str(model))  # with a chat template
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1?", "reference": "2", "label": "gsm8k"}\n')
    path = tmp_path / "my.yaml"
    path.write_text(GSM8K.format(out=tmp_path / "run", model=model, train=tmp_path / "train.jsonl"))
    return str(path)


def test_check_prints_the_plan_and_the_memory_plan(config, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert main(["check", config]) == 0
    out = capsys.readouterr().out
    assert "200 steps into" in out and "64 prompts x 8 samples, up to 512 new tokens" in out
    # 2 layers x 2 KV heads x 16 head dims x (K, V) x 4 bytes (float32 on the CPU) = 0.5 KiB per token
    assert "KV cache 0.5 KiB per token" in out and "check passed" in out
    assert "ranks: 1 on cpu; strategy fsdp2; 3 CPU threads per rank (OMP_NUM_THREADS)" in out or "on cuda" in out
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("override,key", [
    ("data.train=[{path: /nonexistent.jsonl}]", "data.train[0].path"),
    ("model.path=/nonexistent", "model.path"),
    ("rollout.max_new_tokens=4000", "rollout.max_new_tokens"),  # beyond the model's 2048 positions
    # below data.max_prompt_len + rollout.max_new_tokens: checked after the model's positions (tidal.build.check_context_budget)
    ("train.micro_batch_tokens=1000", "train.micro_batch_tokens"),
    ("train.forward_micro_batch_tokens=1000", "train.forward_micro_batch_tokens"),
    ("data.prompt_key=question", "data.prompt_key"),  # the rows have no 'question'
    ("reward.recipes={math: [[answer, 1.0]]}", "reward.recipes"),  # the rows are labelled gsm8k
    ("engine.tp_size=2", "engine.tp_size"),
    ("logging.backends=[wandb]", "logging.backends"),
])
def test_check_fails_like_the_run_would(config, override, key, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["check", config, override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and key in err


def _with_model(config: str, tmp_path, hf_config) -> str:
    """``config`` with its model folder's config.json replaced by ``hf_config`` (tokenizer kept)."""
    hf_config.save_pretrained(tmp_path / "model")
    return config


def test_check_names_the_engine_and_a_sliding_window_family(config, tmp_path, capsys):
    from transformers import Gemma3TextConfig

    _with_model(config, tmp_path, Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=1000, max_position_embeddings=2048, sliding_window=512,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]))
    assert main(["check", config]) == 0
    out = capsys.readouterr().out
    assert "engine: native (engine.backend: native; Tidal's paged engine runs family gemma3)" in out
    # 4 layers x 2 KV heads x 16 x (K, V) x 4 bytes = 1 KiB per token; 3 of the 4 layers slide
    assert ("KV cache 1.0 KiB per token (1 full-attention layers; 3 sliding-window layers (512 tokens; the native engine "
            "keeps at most a window of KV per sequence in their own block pool)") in out


def test_an_unknown_family_is_a_config_error_on_native_and_runs_on_hf(config, tmp_path, capsys):
    from transformers import GPT2Config

    _with_model(config, tmp_path, GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=2048))
    assert main(["check", config]) == 2
    err = capsys.readouterr().err
    assert "config error at 'engine.backend': native: model_type 'gpt2' is no family Tidal knows" in err
    assert "the native engine runs [" in err and "'gemma3'" in err and "'olmo3'" in err and "engine.backend: hf" in err
    assert main(["check", config, "engine.backend=hf"]) == 0
    out = capsys.readouterr().out
    assert "engine: hf (engine.backend: hf; model_type 'gpt2' has no native engine model" in out
    assert "KV cache: 'gpt2' has no family in tidal/families; not counted" in out


def test_check_shows_the_memory_plan_and_its_choices(config, capsys):
    # on this CPU no plan is made unless a device size is given; with one, the plan and its choices
    assert main(["check", config, "run.device=cpu"]) == 0
    assert "memory plan: none on cpu" in capsys.readouterr().out
    assert main(["check", config, "memory.device_memory_gib=80", "memory.host_memory_gib=64"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: 80 GiB device (memory.device_memory_gib)" in out
    settings = next(line for line in out.splitlines() if "  settings:" in line)
    # a tiny model keeps everything on the device
    assert "engine.sleep_level=1 (auto)" in settings and "strategy.offload_optimizer=false (auto)" in settings
    assert main(["check", config, "memory.device_memory_gib=80", "memory.host_memory_gib=64", "engine.sleep_level=2"]) == 0
    assert "engine.sleep_level=2," in capsys.readouterr().out  # given: kept, not marked auto


def test_check_refuses_what_cannot_fit_before_loading(config, tmp_path, capsys):
    # a 70B-shaped config.json (Llama-3-70B's numbers) on one 80 GiB device: exit 2, the smallest combination shown
    _with_model(config, tmp_path, Qwen2Config(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=2048, tie_word_embeddings=False))
    assert main(["check", config, "memory.device_memory_gib=80", "memory.host_memory_gib=1024"]) == 2
    err = capsys.readouterr().err
    assert "the run does not fit in memory: none of the 8 combination(s) of the settings left at auto fits" in err
    assert "engine.sleep_level=2 (auto)" in err and "OVER BUDGET" in err


def _no_task_build(monkeypatch):
    monkeypatch.setattr("tidal.tasks.assets.prepare", lambda *a, **k: pytest.fail("the task would build"))
    monkeypatch.setattr("tidal.tasks.assets._build", lambda *a, **k: pytest.fail("the task would build"))


def test_check_of_a_task_run_checks_its_models_context_before_building_it(tmp_path, capsys, monkeypatch):
    """The task's model (128 positions) is built at the first run; check makes its config without it."""
    _no_task_build(monkeypatch)
    assert main(["check", "quickstart", "data.max_prompt_len=125", f"task.workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'rollout.max_new_tokens'" in err and "128 positions" in err, err
    assert not list(tmp_path.iterdir())  # nothing built

