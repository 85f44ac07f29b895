"""A tiny synthetic vision-language task: count the squares in an image (no downloads).

Everything is built locally: a Qwen2-style byte-level BPE tokenizer with Qwen2-VL's special tokens
and chat template, a Qwen2-VL image processor with small patches, a randomly initialised tiny
``Qwen2VLForConditionalGeneration``, and images of ``n`` coloured squares on a black canvas with
the question "How many squares?" and the reference answer ``n``.

Image geometry: a ``cells x cells`` grid of ``cell`` px cells; with ``patch_size * merge_size ==
cell`` each square fills exactly one image token (the image is never resized).

The warm start teaches the answer *format* only: one supervised pass where every image's label is
drawn at random, independent of the image. The start is therefore at chance, and anything above
chance after RL was learned from the images.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import torch

from tidal.rewards.types import RewardSample

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "How many squares?"
COLORS = [(255, 64, 64), (64, 255, 64), (64, 128, 255), (255, 255, 64), (255, 64, 255), (64, 255, 255)]


@dataclasses.dataclass(kw_only=True)
class SquaresSpec:
    """Shape of the task and of its model. ``max_count`` squares at most (answers 1..max_count)."""

    workdir: str
    seed: int = 0
    max_count: int = 3
    cells: int = 2
    cell: int = 8
    num_train: int = 96
    num_eval: int = 24
    hidden_size: int = 64
    num_layers: int = 2
    vision_dim: int = 32
    warm_start_steps: int = 40
    warm_start_lr: float = 3e-3


@dataclasses.dataclass(kw_only=True)
class SquaresAssets:
    model_path: str
    train_path: str
    eval_path: str


def squares_reward(sample: RewardSample) -> float:
    """1.0 when the response (stripped) is exactly the reference count, else 0.0."""
    return 1.0 if sample.response.strip() == str(sample.reference) else 0.0


def draw_squares(n: int, spec: SquaresSpec, rng: random.Random):
    """An RGB image with ``n`` squares of random colours in distinct random cells."""
    from PIL import Image

    size = spec.cells * spec.cell
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    for k in rng.sample(range(spec.cells * spec.cells), n):
        r, c = divmod(k, spec.cells)
        pixels[r * spec.cell : (r + 1) * spec.cell, c * spec.cell : (c + 1) * spec.cell] = rng.choice(COLORS)
    return Image.fromarray(pixels)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([QUESTION, "user assistant system 0 1 2 3 4 5 6 7 8 9"], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_image_processor(spec: SquaresSpec):
    from transformers import Qwen2VLImageProcessor

    pixels = (spec.cells * spec.cell) ** 2
    return Qwen2VLImageProcessor(patch_size=spec.cell // 2, merge_size=2, temporal_patch_size=2, min_pixels=pixels, max_pixels=pixels)


def build_model(spec: SquaresSpec, tokenizer):
    """A random tiny Qwen2-VL (tied embeddings) whose special-token ids are the tokenizer's."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    heads = 4
    half = spec.hidden_size // heads // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=256,
            rope_scaling={"type": "mrope", "mrope_section": section}, tie_word_embeddings=True,
            eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
        ),
        vision_config=dict(
            depth=1, embed_dim=spec.vision_dim, num_heads=2, mlp_ratio=2, hidden_size=spec.hidden_size, in_channels=3,
            patch_size=spec.cell // 2, spatial_merge_size=2, temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None, tie_word_embeddings=True,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    return model


def _write_split(out: Path, name: str, num: int, spec: SquaresSpec, rng: random.Random) -> Path:
    img_dir = out / "images" / name
    img_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(num):
        n = rng.randint(1, spec.max_count)
        draw_squares(n, spec, rng).save(img_dir / f"{i:05d}.png")
        rows.append({"prompt": f"<image>{QUESTION}", "images": [f"images/{name}/{i:05d}.png"], "reference": str(n)})
    path = out / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def warm_start(model, processor, spec: SquaresSpec, rng: random.Random) -> None:
    """Supervised steps on random labels: the model learns to answer one digit then ``<|im_end|>``."""
    from tidal.data.vision import place_images

    tok = processor.tokenizer
    text = tok.apply_chat_template(place_images("warm start", [{"role": "user", "content": QUESTION}], 1), add_generation_prompt=True, tokenize=False)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr)
    model.train()
    for _ in range(spec.warm_start_steps):
        images = [draw_squares(rng.randint(1, spec.max_count), spec, rng) for _ in range(16)]
        mm = processor.pixel_inputs(images)
        prompt = tok(processor.expand_image_tokens(text, mm["image_grid_thw"][:1]), add_special_tokens=False)["input_ids"]
        answers = [tok(f"{rng.randint(1, spec.max_count)}<|im_end|>", add_special_tokens=False)["input_ids"] for _ in images]
        ids = torch.tensor([prompt + a for a in answers])
        labels = ids.clone()
        labels[:, : len(prompt)] = -100
        loss = model(input_ids=ids, labels=labels, mm_token_type_ids=(ids == processor.image_token_id).int(), **mm).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_squares_assets(spec: SquaresSpec) -> SquaresAssets:
    """Write model folder (weights, config, tokenizer, image processor) and train/eval JSONL under
    ``spec.workdir``; idempotent (a finished build is reused)."""
    from tidal.data.vision import VisionProcessor

    out = Path(spec.workdir)
    model_dir = out / "model"
    assets = SquaresAssets(model_path=str(model_dir), train_path=str(out / "train.jsonl"), eval_path=str(out / "eval.jsonl"))
    if (out / "DONE").is_file():
        return assets
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(spec.seed)
    _write_split(out, "train", spec.num_train, spec, rng)
    _write_split(out, "eval", spec.num_eval, spec, rng)
    tokenizer = build_tokenizer()
    processor = VisionProcessor(tokenizer, build_image_processor(spec))
    model = build_model(spec, tokenizer)
    warm_start(model, processor, spec, rng)
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    (out / "DONE").write_text("ok\n")
    return assets


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tidal.tasks.squares OUT_DIR")
    built = build_squares_assets(SquaresSpec(workdir=sys.argv[1]))
    print(f"model: {built.model_path}\ntrain: {built.train_path}\neval:  {built.eval_path}")
