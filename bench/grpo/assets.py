"""What both frameworks load: a random-initialised model folder per size (bf16 on disk), a
WordLevel tokenizer over the whole vocabulary, and prompts of exact length; for a size that is a
distillation teacher, a teacher folder (the model's files and the tokenizer's)."""

from __future__ import annotations

import json
import os
import random

from bench.grpo.shapes import SHAPES, param_count

TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast"}


def build_tokenizer(vocab_size: int):
    """A WordLevel tokenizer covering the whole vocabulary: ids 0..V-3 are "t0".."t{V-3}", V-2 is
    ``<eos>``, V-1 is ``<pad>``; whitespace split, no special tokens added, no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab["<eos>"], vocab["<pad>"] = vocab_size - 2, vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<eos>")


def build_model_dir(path: str, shape: dict, device: str) -> int:
    """Save a random-initialised Qwen2 model of ``shape`` (bf16 weights) into ``path`` (of its
    ``model_type``'s family when it names one, e.g. ``qwen3_moe``); returns its parameter count.
    (The tokenizer lives in its own folder: next to a qwen2 config.json, transformers 5 would load
    the WordLevel files as a Qwen2Tokenizer, which encodes these prompts to nothing.)"""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    v = shape["vocab_size"]
    kwargs = {k: x for k, x in shape.items() if k != "model_type"}
    cfg = AutoConfig.for_model(shape.get("model_type", "qwen2"), **kwargs, bos_token_id=None, eos_token_id=v - 2, pad_token_id=v - 1)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # a 7B model is built directly in bf16 (no fp32 copy)
    try:
        with torch.device(device):
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)](cfg)  # constructed as is: in the default dtype
    finally:
        torch.set_default_dtype(default)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    return n


def teacher_folder(work_dir: str, size: str, model_dir: str, tokenizer_dir: str) -> str:
    """A folder for ``model.teacher.path``: links to ``model_dir``'s files plus a copy of the
    tokenizer files. Tidal reads a local teacher's tokenizer from its folder and refuses one whose
    vocabulary or special-token ids differ from the student's; the model folder itself stays without
    tokenizer files (see :func:`build_model_dir`: transformers would read them there as a
    Qwen2Tokenizer, which keeps the vocabulary and special ids but encodes these prompts to nothing:
    harmless for the teacher, which only scores the student's token ids)."""
    import shutil

    path = os.path.join(work_dir, f"teacher-{size}")
    shutil.rmtree(path, ignore_errors=True)  # no stale links from an earlier build of the model folder
    os.makedirs(path)
    for name in os.listdir(model_dir):
        if name != "bench_shape.json":
            os.symlink(os.path.abspath(os.path.join(model_dir, name)), os.path.join(path, name))
    for name in os.listdir(tokenizer_dir):
        if name != "config.json":  # the teacher's config.json is the model's
            shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path


def write_prompts(path: str, *, rows: int, prompt_len: int, vocab_size: int, seed: int = 0) -> None:
    """JSONL of ``{"prompt": "t.. t.. ..."}``: each prompt is ``prompt_len`` random vocabulary words."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": " ".join(f"t{rng.randrange(vocab_size - 2)}" for _ in range(prompt_len))}) + "\n")


def model_assets(work_dir: str, size: str, device: str, *, teacher: bool = False) -> dict:
    """The model and tokenizer folders of ``size`` under ``work_dir`` (built unless already there);
    ``teacher``: also its :func:`teacher_folder` (``teacher_dir``, else None)."""
    shape = SHAPES[size]
    model_dir = os.path.join(work_dir, f"model-{size}")
    marker = os.path.join(model_dir, "bench_shape.json")
    if os.path.exists(marker) and json.load(open(marker)) == shape:
        n = param_count(shape)
    else:
        n = build_model_dir(model_dir, shape, device)
        json.dump(shape, open(marker, "w"))
    tok_dir = os.path.join(work_dir, f"tokenizer-{shape['vocab_size']}")
    if not os.path.exists(os.path.join(tok_dir, "config.json")):
        build_tokenizer(shape["vocab_size"]).save_pretrained(tok_dir)
        # Tidal's load_tokenizer wants a config.json; one without a model_type keeps the class as saved.
        json.dump(TOKENIZER_CONFIG, open(os.path.join(tok_dir, "config.json"), "w"))
    return {"size": size, "model_dir": model_dir, "tokenizer_dir": tok_dir, "params": n,
            "params_formula": param_count(shape), "shape": shape,
            "teacher_dir": teacher_folder(work_dir, size, model_dir, tok_dir) if teacher else None}


def prompts_file(work_dir: str, *, size: str, prompt_len: int, prompts_per_step: int) -> str:
    """A prompts file for ``size``'s vocabulary: enough rows for 16 iterations of ``prompts_per_step``."""
    vocab = SHAPES[size]["vocab_size"]
    path = os.path.join(work_dir, f"prompts-v{vocab}-p{prompt_len}-n{prompts_per_step}.jsonl")
    if not os.path.exists(path):
        write_prompts(path, rows=max(64, prompts_per_step * 16), prompt_len=prompt_len, vocab_size=vocab)
    return path
