"""The native engine generates from image prompts (Qwen2-VL / Qwen2.5-VL): M-RoPE positions equal
HF's, greedy output equals the HF engine's, sampled logprobs equal the trainer's forward, prefix
sharing keys on the images, chunked prefill and preemption change nothing, bad inputs are named."""

import numpy as np
import pytest
import torch

from tidal.data import DataConfig, DataSource, PromptDataset
from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.factory import create_engine
from tidal.engine.hf import HFEngine
from tidal.engine.native import NativeEngine
from tidal.engine.native.multimodal import build_multimodal_prompt, mrope_section_columns
from tidal.models import load_causal_lm, load_tokenizer
from tidal.models.lora import hf_weights
from tidal.models.vision import collate_mm_inputs, multimodal_position_ids

from .helpers import assert_completions_match_trainer

CPU = torch.device("cpu")


def _native(model, **kw):
    eng = NativeEngine(model.config, EngineConfig(**kw), device=CPU, dtype=torch.float32)
    eng.load_weights(hf_weights(model, lambda p: p.detach()))
    return eng


def _two_image_prompt(proc, ds):
    """One prompt with two images, text between them and a stray image token (text, not a placeholder)."""
    c = proc.tokenizer.convert_tokens_to_ids
    a, b = ds[0], ds[1]
    img, vs, ve = c("<|image_pad|>"), c("<|vision_start|>"), c("<|vision_end|>")
    n_a = int(a.mm_inputs["image_grid_thw"][0].prod()) // 4
    n_b = int(b.mm_inputs["image_grid_thw"][0].prod()) // 4
    ids = [7, 8, vs] + [img] * n_a + [ve, 9, img, 10, vs] + [img] * n_b + [ve, 11, 12]
    mm = collate_mm_inputs([a.mm_inputs, b.mm_inputs])
    return ids, mm


def test_mrope_positions_equal_hf_rope_index(vl):
    proc, model, ds = vl
    cfg = model.config
    for ids, mm in [(ds[0].prompt_ids, ds[0].mm_inputs), _two_image_prompt(proc, ds)]:
        got = build_multimodal_prompt(ids, mm, cfg)
        ids_BT = torch.tensor([ids])
        from tidal.models.vision import placeholder_mask

        stray = (ids_BT == cfg.image_token_id) & ~placeholder_mask(ids_BT, cfg)
        ids_BT = torch.where(stray, torch.full_like(ids_BT, cfg.vision_end_token_id), ids_BT)  # as the trainer does
        want = multimodal_position_ids(model, ids_BT, torch.ones_like(ids_BT), mm)[:, 0]
        assert got.positions_3L.tolist() == want.tolist()
        assert got.rope_delta == int(want.max()) + 1 - len(ids)
        # generated tokens continue as text: position i + rope_delta, three equal ids
        assert got.positions_3(len(ids) - 1, 3).tolist() == [[int(want[0, -1]), int(want[0, -1]) + 1, int(want[0, -1]) + 2]] * 3
        assert (got.feature_rows_L >= 0).sum() == int(mm["image_grid_thw"].prod(-1).sum()) // 4


def test_mrope_columns_follow_sections():
    # head_dim 16: freqs 0-3 time, 4-5 height, 6-7 width; the sin half repeats the cos half
    assert mrope_section_columns([4, 2, 2], 16).tolist() == [0, 0, 0, 0, 1, 1, 2, 2] * 2
    with pytest.raises(ValueError, match="head_dim/2"):
        mrope_section_columns([4, 2, 1], 16)


def test_native_greedy_equals_hf_engine_on_image_and_text_prompts(vl):
    proc, model, ds = vl
    text = proc.tokenizer("plain text row", add_special_tokens=False)["input_ids"]
    two_ids, two_mm = _two_image_prompt(proc, ds)
    prompts = [ds[0].prompt_ids, text, ds[1].prompt_ids, two_ids]
    mm = [ds[0].mm_inputs, None, ds[1].mm_inputs, two_mm]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    hf = HFEngine(model.config, EngineConfig(backend="hf", max_num_seqs=8), device=CPU, dtype=torch.float32)
    hf.load_weights(hf_weights(model, lambda p: p.detach()))
    want = hf.generate(prompts, params, mm_inputs=mm)
    got = _native(model, block_size=4).generate(prompts, params, mm_inputs=mm)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=1e-4, atol=1e-4)
    # the image matters: the same ids with the other image give other logprobs
    swapped = _native(model, block_size=4).generate([ds[0].prompt_ids], params, mm_inputs=[ds[1].mm_inputs])
    assert max(abs(a - b) for a, b in zip(swapped[0].logprobs, got[0].logprobs)) > 1e-4


def test_speculation_on_image_prompts_keeps_greedy_tokens_and_sampled_logprobs(vl):
    """Drafts verified at text positions after image prompts (M-RoPE offsets): greedy tokens equal
    the plain engine's, sampled logprobs equal the trainer's forward."""
    from tests.engine.helpers import OracleDrafter

    proc, model, ds = vl
    items = [ds[i] for i in range(3)]
    prompts, mm = [it.prompt_ids for it in items], [it.mm_inputs for it in items]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    want = _native(model, block_size=4, speculative="off").generate(prompts, greedy, mm_inputs=mm)
    eng = _native(model, block_size=4, speculative="on")
    refs = {tuple(p): w.token_ids for p, w in zip(prompts, want)}  # prompts 0 and 1 share ids (not images)
    eng.spec.index = OracleDrafter(refs, "partly", model.config.get_text_config().vocab_size)
    got = eng.generate(prompts, greedy, mm_inputs=mm)
    assert [c.token_ids for c in got] == [c.token_ids for c in want] and eng.stats["spec_accepted"] > 0
    sampled = eng.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=3, ignore_eos=True), mm_inputs=mm)
    assert eng.stats["spec_steps"] > 0
    assert_completions_match_trainer(model, proc.pad_token_id, sampled, [mm[b // 2] for b in range(6)])


def test_native_sampled_logprobs_equal_trainer_forward(vl):
    proc, model, ds = vl
    items = [ds[i] for i in range(3)]
    comps = _native(model, block_size=4).generate(
        [it.prompt_ids for it in items], SamplingParams(max_new_tokens=4, n=3, seed=3, ignore_eos=True),
        mm_inputs=[it.mm_inputs for it in items],
    )
    assert_completions_match_trainer(model, proc.pad_token_id, comps, [items[b // 3].mm_inputs for b in range(9)])


def test_prefix_cache_shares_samples_of_one_prompt_never_other_images(vl):
    proc, model, ds = vl
    a, b = ds[0], ds[1]
    assert a.prompt_ids == b.prompt_ids  # same text, different images
    eng = _native(model, block_size=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=2, n=4, ignore_eos=True)
    eng.generate([a.prompt_ids, b.prompt_ids], params, mm_inputs=[a.mm_inputs, b.mm_inputs])
    full_blocks = (len(a.prompt_ids) - 1) // 4
    # each prompt's first sample computes its blocks, the other three hit; prompt b never hits a's
    assert eng.stats["prefix_hit_tokens"] == 2 * 3 * full_blocks * 4
    separate = _native(model, block_size=4).generate([b.prompt_ids], params, mm_inputs=[b.mm_inputs])
    together = _native(model, block_size=4).generate([a.prompt_ids, b.prompt_ids], params, mm_inputs=[a.mm_inputs, b.mm_inputs])
    assert sum((c.logprobs for c in together[4:]), []) == pytest.approx(sum((c.logprobs for c in separate), []), abs=1e-5)


def test_chunked_prefill_and_preemption_give_the_same_tokens(vl):
    proc, model, ds = vl
    items = [ds[i] for i in range(4)]
    args = ([it.prompt_ids for it in items], SamplingParams(temperature=0.0, max_new_tokens=8, n=2, ignore_eos=True))
    mm = [it.mm_inputs for it in items]
    ref = _native(model, block_size=4).generate(*args, mm_inputs=mm)
    chunked = _native(model, block_size=4, max_num_batched_tokens=5).generate(*args, mm_inputs=mm)
    small = _native(model, block_size=4, kv_cache_max_tokens=4 * (len(items[0].prompt_ids) // 4 + 4))
    tight = small.generate(*args, mm_inputs=mm)
    assert small.stats["preemptions"] > 0
    assert [c.token_ids for c in chunked] == [c.token_ids for c in ref] == [c.token_ids for c in tight]


def test_engine_from_saved_folder_and_sleep_wake(vl, squares_assets):
    proc, model, ds = vl
    eng = NativeEngine.from_pretrained(squares_assets.model_path, EngineConfig(block_size=4), device=CPU, dtype=torch.float32)
    ref = _native(model, block_size=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    want = ref.generate([ds[2].prompt_ids], params, mm_inputs=[ds[2].mm_inputs])
    assert eng.generate([ds[2].prompt_ids], params, mm_inputs=[ds[2].mm_inputs])[0].token_ids == want[0].token_ids
    eng.sleep(2)
    eng.wake_up()
    assert eng.generate([ds[2].prompt_ids], params, mm_inputs=[ds[2].mm_inputs])[0].token_ids == want[0].token_ids
    assert "vision" not in eng.memory_report()  # the tower's weights count as weights
    tower = sum(p.numel() for p in eng.model.visual.parameters()) * 4
    assert eng.memory_report()["weights"] >= tower > 0


def test_bad_image_inputs_are_named(vl):
    proc, model, ds = vl
    eng = _native(model, block_size=4)
    params = SamplingParams(max_new_tokens=2)
    short = ds[0].prompt_ids[:]
    short.remove(model.config.image_token_id)  # one placeholder fewer than the image needs
    with pytest.raises(ValueError, match=r"prompt 1: an image of grid .* needs 4 placeholders, the prompt has 3"):
        eng.generate([ds[0].prompt_ids, short], params, mm_inputs=[ds[0].mm_inputs, ds[0].mm_inputs])
    with pytest.raises(ValueError, match="prompt 0: 1 image placeholder runs in the prompt for 2 images"):
        eng.generate([ds[0].prompt_ids], params, mm_inputs=[collate_mm_inputs([ds[0].mm_inputs, ds[1].mm_inputs])])
    with pytest.raises(ValueError, match="2 mm_inputs for 1 prompts"):
        eng.generate([ds[0].prompt_ids], params, mm_inputs=[None, None])
    t1, h, w = ds[0].mm_inputs["image_grid_thw"][0].tolist()
    video = dict(ds[0].mm_inputs, image_grid_thw=torch.tensor([[2 * t1, h, w]]))
    video["pixel_values"] = torch.cat([video["pixel_values"]] * 2)
    with pytest.raises(ValueError, match="still images only"):
        eng.generate([ds[0].prompt_ids], params, mm_inputs=[video])


def test_factory_builds_native_for_vl_and_refuses_unknown_vl_types(vl):
    _, model, _ = vl
    assert isinstance(create_engine(model.config, EngineConfig(backend="native"), device=CPU, dtype=torch.float32), NativeEngine)

    other = type(model.config).from_dict(model.config.to_dict())
    other.model_type = "llava_like"
    with pytest.raises(ValueError, match=r"'llava_like' is no family Tidal knows; the native engine runs \[.*'qwen2_5_vl', 'qwen2_vl'.*engine.backend: hf"):
        create_engine(other, EngineConfig(backend="native"), device=CPU, dtype=torch.float32)


def test_qwen2_5_vl_native_logprobs_equal_trainer(qwen2_5_vl):
    proc, model, prompts, mm = qwen2_5_vl
    comps = _native(model, block_size=4).generate(prompts, SamplingParams(max_new_tokens=4, n=2, seed=1, ignore_eos=True), mm_inputs=mm)
    assert all(len(c.token_ids) == 4 for c in comps)
    assert_completions_match_trainer(model, proc.pad_token_id, comps, [mm[b // 2] for b in range(4)])
    assert np.isfinite(comps[0].logprobs).all()


def _tp_worker(rank: int, store_path: str, out_dir: str, model_path: str, eval_path: str):
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    proc = load_tokenizer(model_path)
    model = load_causal_lm(model_path)
    ds = PromptDataset([DataSource(path=eval_path)], proc, DataConfig(shuffle=False), seed=0)
    eng = NativeEngine(model.config, EngineConfig(block_size=4, max_num_batched_tokens=16), device=CPU,
                       dtype=torch.float32, tp_group=group)
    eng.load_weights(hf_weights(model, lambda p: p.detach()))
    text = proc.tokenizer("plain text row", add_special_tokens=False)["input_ids"]
    out = []
    for params in (SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True),
                   SamplingParams(max_new_tokens=5, n=2, seed=3, ignore_eos=True)):
        comps = eng.generate([ds[0].prompt_ids, text, ds[1].prompt_ids], params, mm_inputs=[ds[0].mm_inputs, None, ds[1].mm_inputs])
        out.append([(c.token_ids, c.logprobs) for c in comps])
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_gloo_image_prompts_equal_tp1(vl, squares_assets, tmp_path):
    """Text layers sharded over 2 ranks, the vision tower replicated: same completions as one rank."""
    import torch.multiprocessing as mp

    proc, model, ds = vl
    mp.start_processes(_tp_worker, args=(str(tmp_path / "store"), str(tmp_path), squares_assets.model_path,
                                         squares_assets.eval_path), nprocs=2, start_method="spawn")
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0 == r1
    eng = _native(model, block_size=4, max_num_batched_tokens=16)
    text = proc.tokenizer("plain text row", add_special_tokens=False)["input_ids"]
    for params, tp2 in zip((SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True),
                            SamplingParams(max_new_tokens=5, n=2, seed=3, ignore_eos=True)), r0):
        tp1 = eng.generate([ds[0].prompt_ids, text, ds[1].prompt_ids], params, mm_inputs=[ds[0].mm_inputs, None, ds[1].mm_inputs])
        assert [c.token_ids for c in tp1] == [t for t, _ in tp2]
        for c, (_, lp) in zip(tp1, tp2):
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(c.logprobs), rtol=1e-4, atol=1e-4)
