"""Image rows: placeholders in chats, image loading, image-token expansion, PromptDataset items."""

import io
import json

import pytest
from PIL import Image

from tidal.data import DataConfig, DataSource, PromptDataset
from tidal.data.vision import VisionProcessor, load_image, place_images
from tidal.models import load_tokenizer


def test_placeholders_split_the_text():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "A<image>B<image>"}]
    out = place_images("row", msgs, 2)
    assert out[0] == msgs[0]
    assert out[1]["content"] == [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"}, {"type": "image"}]


def test_images_go_first_in_the_first_user_message_without_placeholders():
    msgs = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "sure?"}]
    out = place_images("row", msgs, 2)
    assert out[0]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "count"}]
    assert out[1:] == msgs[1:]


def test_listed_image_items_are_kept_and_counted():
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    assert place_images("row", msgs, 1) == msgs
    with pytest.raises(ValueError, match="row: the messages list 1 image items but the row has 2 images"):
        place_images("row", msgs, 2)
    with pytest.raises(ValueError, match="2 '<image>' placeholders but the row has 1 images"):
        place_images("row", [{"role": "user", "content": "<image><image>"}], 1)


def test_load_image_from_path_bytes_and_dict(tmp_path):
    img = Image.new("RGB", (4, 3), (10, 20, 30))
    img.save(tmp_path / "a.png")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    for ref in ["a.png", str(tmp_path / "a.png"), buf.getvalue(), {"bytes": buf.getvalue(), "path": None}, {"bytes": None, "path": "a.png"}]:
        got = load_image(ref, tmp_path)
        assert got.size == (4, 3) and got.getpixel((0, 0)) == (10, 20, 30)
    with pytest.raises(FileNotFoundError, match="b.png"):
        load_image("b.png", tmp_path)


def test_image_tokens_expand_per_image_grid(squares_assets):
    proc = load_tokenizer(squares_assets.model_path)
    assert isinstance(proc, VisionProcessor) and proc.pad_token_id == proc.tokenizer.pad_token_id
    # 16x16 px, patch 4 -> a 4x4 patch grid (temporal 1), merged 2x2 -> 4 tokens per image
    mm = proc.pixel_inputs([Image.new("RGB", (16, 16)), Image.new("RGB", (16, 16))])
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert mm["pixel_values"].shape == (32, 3 * 2 * 4 * 4)
    pad = proc.image_token
    assert proc.expand_image_tokens(f"a{pad}b{pad}", mm["image_grid_thw"]) == f"a{pad * 4}b{pad * 4}"


def test_dataset_items_with_and_without_images(squares_assets, tmp_path):
    src = tmp_path / "rows.jsonl"
    img = squares_assets.train_path.replace("train.jsonl", "images/train/00000.png")
    rows = [{"prompt": "<image>How many squares?", "images": [img], "reference": "2"}, {"prompt": "no image here"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = load_tokenizer(squares_assets.model_path)
    ds = PromptDataset([DataSource(path=str(src))], proc, DataConfig(shuffle=False), seed=0)
    with_image, text = ds[0], ds[1]
    assert with_image.prompt_ids.count(proc.image_token_id) == 4
    assert with_image.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert with_image.images == [img]  # passed through as given
    assert text.mm_inputs is None and proc.image_token_id not in text.prompt_ids
    # the text tokenizer alone passes images through (no image tokens, no pixel inputs)
    plain = PromptDataset([DataSource(path=str(src))], proc.tokenizer, DataConfig(shuffle=False), seed=0)
    assert plain[0].mm_inputs is None and proc.image_token_id not in plain[0].prompt_ids
    assert "<image>How many squares?" in plain[0].prompt_text  # left as text


def test_image_prompts_are_never_left_truncated(squares_assets, tmp_path):
    src = tmp_path / "rows.jsonl"
    img = squares_assets.train_path.replace("train.jsonl", "images/train/00000.png")
    src.write_text(json.dumps({"prompt": "How many squares?", "images": [img]}) + "\n")
    proc = load_tokenizer(squares_assets.model_path)
    with pytest.raises(ValueError, match="cannot be left-truncated"):
        PromptDataset([DataSource(path=str(src))], proc, DataConfig(max_prompt_len=8, overlong_prompt="left_truncate"), seed=0)
