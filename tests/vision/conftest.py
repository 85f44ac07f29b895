"""A tiny Qwen2-VL with its tokenizer, image processor and squares data, built once per session."""

import pytest

from tidal.tasks.squares import SquaresSpec, build_squares_assets


@pytest.fixture(scope="session")
def squares_assets(tmp_path_factory):
    return build_squares_assets(SquaresSpec(workdir=str(tmp_path_factory.mktemp("squares"))))


@pytest.fixture(scope="module")
def vl(squares_assets):
    """(processor, the squares Qwen2-VL model, the eval prompt dataset)."""
    from tidal.data import DataConfig, DataSource, PromptDataset
    from tidal.models import load_causal_lm, load_tokenizer

    proc = load_tokenizer(squares_assets.model_path)
    model = load_causal_lm(squares_assets.model_path)
    ds = PromptDataset([DataSource(path=squares_assets.eval_path)], proc, DataConfig(shuffle=False), seed=0)
    return proc, model, ds


@pytest.fixture(scope="session")
def qwen2_5_vl(squares_assets):
    """A random tiny Qwen2.5-VL (windowed vision attention) on the squares tokenizer, and two image
    prompts: (processor, model, prompt ids per image, pixel inputs per image)."""
    import random

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tidal.data.vision import place_images
    from tidal.models import load_tokenizer
    from tidal.models.logprobs import attach_logprob_method
    from tidal.tasks.squares import draw_squares

    proc = load_tokenizer(squares_assets.model_path)
    tid = proc.tokenizer.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(proc.tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]}),
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1]),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    attach_logprob_method(model)
    text = proc.apply_chat_template(place_images("t", [{"role": "user", "content": "How many squares?"}], 1), add_generation_prompt=True, tokenize=False)
    rng, spec = random.Random(0), SquaresSpec(workdir="unused")
    images = [draw_squares(2, spec, rng), draw_squares(1, spec, rng)]
    return proc, model, [proc.prompt_ids(text, [im]) for im in images], [proc.pixel_inputs([im]) for im in images]
