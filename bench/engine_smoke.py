"""Native-engine smoke of one model family on one device: a random model of a family's config, its
weights handed over in memory, ``generate`` of ``prompts`` x ``n`` forced completions, then sleep and
wake; prints one JSON line. Small enough to run under ``compute-sanitizer`` (the GPU check of a
family that crashes: which kernel reads out of bounds).

    python bench/engine_smoke.py --family qwen3_5 --size tiny --prompts 4 --n 4 --prompt-len 64 --new 64
    compute-sanitizer --tool memcheck python bench/engine_smoke.py --family qwen3_5 --size tiny ...

``--size``: ``tiny`` (hidden 256, 4 layers: quick, sanitizer-friendly) or ``full`` (the shape of
``bench.grpo.shapes.FAMILY_SHAPES``). On CPU every engine check of the families runs in tests/engine;
this script is for the device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def tiny_shape(shape: dict) -> dict:
    """The family's shape cut down: hidden 256, 4 layers (the family's layer pattern kept), its
    vocabulary, heads and head dims as they are (the kernels see the real head shapes)."""
    out = dict(shape)
    out.update(hidden_size=256, num_hidden_layers=4, intermediate_size=512)
    if "moe_intermediate_size" in out:
        out.update(moe_intermediate_size=128)
    if "shared_expert_intermediate_size" in out:
        out.update(shared_expert_intermediate_size=128)
    if "layer_types" in out:
        out["layer_types"] = out["layer_types"][:4]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", required=True, help="a key of bench.grpo.shapes.FAMILY_SHAPES")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="generate / sleep / wake rounds")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-fla", action="store_true", help="Gated DeltaNet through the torch forms, not flash-linear-attention's kernels")
    p.add_argument("--check-finite", action="store_true",
                   help="hooks on every layer's mixer and MLP: the first non-finite output is reported (module, step, batch shape)")
    p.add_argument("--compare-hf", type=int, default=0, metavar="K",
                   help="teacher-force K completions through the HF model (bf16, same device) and report the logprob difference")
    p.add_argument("--set", action="append", default=[], help="engine config override KEY=VALUE (e.g. kv_cache_max_tokens=4096)")
    args = p.parse_args(argv)

    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    from bench.grpo.shapes import FAMILY_SHAPES
    from tidal.engine.base import SamplingParams
    from tidal.engine.config import EngineConfig
    from tidal.engine.native import NativeEngine

    shape = FAMILY_SHAPES[args.family]
    if args.size == "tiny":
        shape = tiny_shape(shape)
    kwargs = {k: v for k, v in shape.items() if k != "model_type"}
    v = shape["vocab_size"]
    hf_config = AutoConfig.for_model(shape["model_type"], **kwargs, bos_token_id=None, eos_token_id=v - 2, pad_token_id=v - 1)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)](hf_config).to(torch.bfloat16)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = type(getattr(EngineConfig(), key))(value) if hasattr(EngineConfig(), key) else value
    cfg = EngineConfig(**overrides)
    if args.no_fla:
        import tidal.engine.native.models.qwen3_5 as hybrid

        hybrid.fla_available = lambda: False
    engine = NativeEngine(model.config, cfg, device=torch.device(args.device), dtype=torch.bfloat16)
    engine.load_weights(model.state_dict().items())
    hf_model = model if args.compare_hf else None
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    bad: list[dict] = []
    if args.check_finite:
        calls = {"n": 0}

        def hook(name):
            def check(module, inputs, output):
                if output is None or (args.device == "cuda" and torch.cuda.is_current_stream_capturing()):
                    return  # a CUDA graph being captured: no host sync (the replays are checked at the next eager step)
                calls["n"] += 1
                out = output[0] if isinstance(output, tuple) else output
                if not bad and not torch.isfinite(out).all():
                    x = inputs[0] if inputs else None
                    bad.append({"module": name, "call": calls["n"], "shape": list(out.shape),
                                "input_finite": None if x is None or not torch.is_tensor(x) else bool(torch.isfinite(x).all()),
                                "nonfinite_rows": int((~torch.isfinite(out.reshape(out.shape[0], -1))).any(-1).sum())})
                    print(json.dumps({"figure": "nonfinite", **bad[0]}), flush=True)
            return check

        for name, module in engine.model.named_modules():
            if name.endswith(("linear_attn", "self_attn", "mlp")) or name == "model.embed_tokens":
                module.register_forward_hook(hook(name))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, v - 2, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, n=args.n, ignore_eos=True, seed=3)
    rounds = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        if args.device == "cuda":
            torch.cuda.synchronize()
        gen_s = time.perf_counter() - t0
        lengths = sorted({len(o.token_ids) for o in outs})
        finite = all(all(x == x and x <= 0 for x in o.logprobs) for o in outs)
        engine.sleep(1)
        if args.device == "cuda":
            torch.cuda.synchronize()
        engine.wake_up()
        rounds.append({"round": r, "generate_s": round(gen_s, 3), "lengths": lengths, "logprobs_ok": finite,
                       "completions": len(outs)})
    compare = None
    if hf_model is not None:
        diffs = []
        with torch.no_grad():
            for i, o in enumerate(outs[: args.compare_hf]):
                ids = torch.tensor([prompts[i // args.n] + list(o.token_ids)], device=args.device)
                logits = hf_model(ids).logits[0, args.prompt_len - 1 : -1].float()
                ref = torch.log_softmax(logits, -1).gather(-1, ids[0, args.prompt_len:, None])[:, 0]
                diffs.append((ref - torch.tensor(o.logprobs, device=args.device)).abs())
        d = torch.cat(diffs)
        compare = {"abs_logp_diff_mean": float(d.mean()), "abs_logp_diff_max": float(d.max()), "tokens": int(d.numel())}
    print(json.dumps({"figure": "engine_smoke", "family": args.family, "size": args.size, "prompts": args.prompts,
                      "n": args.n, "prompt_len": args.prompt_len, "new": args.new, "rounds": rounds,
                      "nonfinite": bad, "fla": not args.no_fla, "set": args.set, "compare_hf": compare,
                      "memory": engine.memory_report()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
