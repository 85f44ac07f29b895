"""GPU check of the DeepSpeed ZeRO strategy against FSDP2 (CUDA, bf16, NCCL). Prints one JSON object.

Run on the GPU machine, one process per GPU, with DeepSpeed's wheels carried (bench/deepspeed_wheels.sh):

    torchrun --standalone --nproc_per_node <GPUs> bench/deepspeed_check.py [--out FILE] [--hidden 1024 --layers 8]

Every case starts from the same randomly initialised Qwen2 (fp32 on CPU, seed 0) and rank-dependent
random token data, and trains a few optimizer steps of several micro-batches (loss shares over the
global token count, clipping active, warmup + cosine LR, weight decay). Sections of the JSON:

- ``parity.<case>``: per-step global loss, grad norm and LR for FSDP2 and DeepSpeed (``z1``, ``z2``,
  ``z3``, ``z2_offload``, ``z3_offload``: ZeRO-Offload of the optimizer), their relative
  differences, and after training (full fp32 masters, ``full_model_state_dict``) the largest
  parameter difference and ``update_rel_diff`` = ||W_ds - W_fsdp|| / ||W_fsdp - W_0||. Step 0 runs
  on identical bf16 weights, so its loss agrees to kernel noise; later steps drift by bf16 rounding
  (Adam moves near-zero-gradient elements by ~lr whatever the noise, hence the whole-update measure).
- ``weight_sync.<case>``: ``update_engine_weights`` (ZeRO-3 GatheredParameters buckets) into a bf16
  HF rollout engine: every engine weight equals ``full_weights(bf16)`` and the FSDP2 actor's full
  weights before training (both are the fp32 masters rounded); greedy generations of both engines.
- ``offload.<case>``: CUDA memory allocated (GiB) around offload_model / offload_optimizer /
  reload of the trained actor against the bytes that must move, weights and this rank's optimizer
  state (fp32 masters, moments) bit-identical after the round trip, a further step working;
  and for the frozen reference: memory while offloaded and reloaded, logprobs equal to a plain
  bf16 HF copy before and after an offload/reload cycle.
- ``resume.<case>``: save through tidal.run.checkpoint (DCP), load into a fresh strategy, one
  step on both: loss and weights equal (exact).
- ``ok``: every boolean check; ``errors``: exceptions per case (a failing case does not stop the rest).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import json
import math
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tidal.distributed import init_runtime
from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.hf import HFEngine
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy
from tidal.sync import update_engine_weights
from tidal.run import checkpoint as ckpt

OPTIM = OptimConfig(lr=1e-4, weight_decay=0.01, warmup_steps=1, scheduler="cosine", min_lr_ratio=0.1, max_grad_norm=1.0)
CASES = {
    "z1": dict(zero_stage=1), "z2": dict(zero_stage=2), "z3": dict(zero_stage=3),
    "z2_offload": dict(zero_stage=2, offload_optimizer=True), "z3_offload": dict(zero_stage=3, offload_optimizer=True),
}


def gib(x: int) -> float:
    return round(x / 2**30, 4)


def mem(device) -> float:
    gc.collect()  # engines of earlier cases hold reference cycles
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    return gib(torch.cuda.memory_allocated(device))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def offloaded_bytes(case: str, n_params: int, world: int) -> int:
    """Device bytes per rank that offload_model + offload_optimizer must free at least: bf16
    parameters (partitioned at ZeRO-3), and unless ZeRO-Offload keeps them on CPU anyway, the fp32
    master partition and the two fp32 AdamW moment partitions."""
    stage = CASES[case]["zero_stage"]
    lp = 2 * n_params // (world if stage == 3 else 1)
    return lp if CASES[case].get("offload_optimizer") else lp + 12 * n_params // world


class Bench:
    def __init__(self, args):
        self.args = args
        self.rt = init_runtime(tp_size=1, device=args.device, timeout_s=args.hang_s)
        self.dev = self.rt.device
        self.cuda = self.dev.type == "cuda"
        auto = torch.bfloat16 if self.cuda else torch.float32
        self.dtype = auto if args.param_dtype == "auto" else getattr(torch, args.param_dtype)  # compute dtype
        self.hf_cfg = Qwen2Config(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=False,
            eos_token_id=None,
        )
        torch.manual_seed(0)
        self.base_sd = copy.deepcopy(Qwen2ForCausalLM(self.hf_cfg).state_dict())
        self.n_params = sum(v.numel() for v in self.base_sd.values())
        self.res = {"world": self.rt.world_size, "device": torch.cuda.get_device_name(self.dev) if self.cuda else "cpu",
                    "params_M": round(self.n_params / 1e6, 2),
                    "parity": {}, "weight_sync": {}, "offload": {}, "resume": {}, "ok": {}, "errors": {}}

    # ---- pieces ------------------------------------------------------------------------------
    def model(self) -> torch.nn.Module:
        m = Qwen2ForCausalLM(self.hf_cfg)
        m.load_state_dict(self.base_sd)
        attach_logprob_method(m)
        return m

    def batches(self, step: int):
        g = torch.Generator().manual_seed(1000 * step + self.rt.rank)
        out = []
        for m in range(self.args.micro):
            T = self.args.seq - 8 * m
            ids = torch.randint(1, self.args.vocab, (self.args.batch, T), generator=g)
            mask = torch.ones_like(ids)
            mask[0, T // 2 :] = 0
            out.append((ids.to(self.dev), mask.to(self.dev)))
        return out

    def train(self, strategy, state, steps: int, first: int = 0):
        log = []
        for step in range(first, first + steps):
            mbs = self.batches(step)
            total = strategy.runtime.all_reduce_sum([sum(float(m[:, 1:].sum()) for _, m in mbs)])[0]
            loss = 0.0
            sync(self.dev)
            t0 = time.perf_counter()
            for i, (ids, mask) in enumerate(mbs):
                logp, _ = token_logprobs(state.model, ids, mask, chunk_tokens=1024)
                share = -(logp[:, 1:].float() * mask[:, 1:]).sum() / total
                strategy.backward(share, state, sync_grads=i == len(mbs) - 1)
                loss += float(share)
            metrics = strategy.optimizer_step(state)
            sync(self.dev)
            metrics["step_s"] = time.perf_counter() - t0
            metrics["loss"] = strategy.runtime.all_reduce_sum([loss])[0]
            log.append(metrics)
        return log

    def trainable(self, backend_kwargs: dict):
        strategy = get_strategy(StrategyConfig(param_dtype=self.args.param_dtype, **backend_kwargs), self.rt)
        return strategy, strategy.prepare_trainable(self.model(), OPTIM, lr=OPTIM.lr, total_steps=self.args.steps + 2)

    def masters(self, strategy, model) -> dict[str, torch.Tensor]:
        """Full fp32 weights on every rank (the export path gathers to rank 0; broadcast the max diff)."""
        return strategy.full_model_state_dict(model)

    def check(self, section: str, case: str, name: str, value: bool) -> None:
        self.res["ok"][f"{section}.{case}.{name}"] = bool(value)

    # ---- sections --------------------------------------------------------------------------------
    def parity(self, fsdp_log, fsdp_sd, case: str):
        strategy, state = self.trainable(dict(backend="deepspeed", **CASES[case]))
        log = self.train(strategy, state, self.args.steps)
        sd = self.masters(strategy, state.model)
        diff, upd = [0.0], [0.0]
        if self.rt.is_main:
            diff = [max(float((sd[k] - fsdp_sd[k]).abs().max()) for k in fsdp_sd)]
            # ||W_ds - W_fsdp|| / ||W_fsdp - W_0||: how far apart the two trainings' updates are
            num = sum(float((sd[k] - fsdp_sd[k]).double().square().sum()) for k in fsdp_sd)
            den = sum(float((fsdp_sd[k] - self.base_sd[k]).double().square().sum()) for k in fsdp_sd)
            upd = [math.sqrt(num / den)]
        diff, upd = strategy.runtime.all_reduce_max(diff + upd)
        rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
        out = {
            "ds": log, "loss_rel_diff": [rel(a["loss"], b["loss"]) for a, b in zip(log, fsdp_log)],
            "grad_norm_rel_diff": [rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(log, fsdp_log)],
            "lr_equal": [a["lr"] == b["lr"] for a, b in zip(log, fsdp_log)], "param_max_abs_diff": diff,
            "update_rel_diff": upd,
            "step_s_mean": sum(x["step_s"] for x in log[1:]) / max(1, len(log) - 1),
        }
        self.res["parity"][case] = out
        self.check("parity", case, "step0_loss_rel<1e-3", out["loss_rel_diff"][0] < 1e-3)
        self.check("parity", case, "loss_rel<2e-2", max(out["loss_rel_diff"]) < 2e-2)
        self.check("parity", case, "grad_norm_rel<5e-2", max(out["grad_norm_rel_diff"]) < 5e-2)
        self.check("parity", case, "lr_equal", all(out["lr_equal"]))
        self.check("parity", case, "not_skipped", all(x["skipped"] == 0 for x in log))
        # Adam moves near-zero-gradient elements by ~lr whatever their sign noise, so the max
        # difference is not a criterion; the update as a whole must agree
        self.check("parity", case, "update_rel<0.1", upd < 0.1)
        return strategy, state

    def weight_sync(self, case: str, fsdp_full0: dict):
        strategy, state = self.trainable(dict(backend="deepspeed", **CASES[case]))
        full0 = dict(strategy.full_weights(state.model, self.dtype))
        self.check("weight_sync", case, "initial_equals_fsdp2", all(torch.equal(full0[n], fsdp_full0[n]) for n in fsdp_full0))
        self.train(strategy, state, 1)
        engine = HFEngine(self.hf_cfg, EngineConfig(), device=self.dev, dtype=self.dtype)
        t0 = time.perf_counter()
        sent = update_engine_weights(strategy, state.model, engine, dtype=self.dtype)
        sync_s = time.perf_counter() - t0
        full = dict(strategy.full_weights(state.model, self.dtype))
        equal = all(torch.equal(p, full[n]) for n, p in engine.model.named_parameters())
        changed = any(not torch.equal(full[n], full0[n]) for n in full)
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
        self.res["weight_sync"][case] = {"bytes": sent, "seconds": sync_s, "engine_equal": equal, "changed_by_step": changed,
                                         "greedy": [o.token_ids for o in outs]}
        self.check("weight_sync", case, "engine_equal", equal)
        self.check("weight_sync", case, "changed_by_step", changed)
        del engine
        return strategy, state

    def optimizer_snapshot(self, state) -> list[torch.Tensor]:
        """This rank's ZeRO optimizer state (fp32 master partition, AdamW moments), copied to CPU."""
        out = []

        def walk(x):
            if isinstance(x, torch.Tensor):
                out.append(x.detach().to("cpu", copy=True))
            elif isinstance(x, dict):
                for k in sorted(x, key=str):
                    walk(x[k])
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(state.optimizer.state_dict())
        return out

    def offload(self, case: str, strategy, state):
        opt_before = self.optimizer_snapshot(state)
        out = {"start": mem(self.dev)}
        before = {n: t.clone() for n, t in strategy.full_weights(state.model, self.dtype)}
        strategy.offload_model(state.model)
        out["after_offload_model"] = mem(self.dev)
        strategy.offload_optimizer(state)
        out["after_offload_optimizer"] = mem(self.dev)
        strategy.reload_model(state.model)
        strategy.reload_optimizer(state)
        out["after_reload"] = mem(self.dev)
        after = dict(strategy.full_weights(state.model, self.dtype))
        out["weights_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
        out["masters_and_moments_unchanged"] = all(torch.equal(a, b) for a, b in zip(opt_before, self.optimizer_snapshot(state)))
        log = self.train(strategy, state, 1, first=5)
        out["step_after_reload_ok"] = math.isfinite(log[0]["loss"]) and log[0]["skipped"] == 0
        out["expected_freed_gib"] = gib(offloaded_bytes(case, self.n_params, self.rt.world_size))
        out["freed_gib"] = round(out["start"] - out["after_offload_optimizer"], 4)
        if self.cuda:
            self.check("offload", case, "actor_freed", out["freed_gib"] >= 0.9 * out["expected_freed_gib"])
            self.check("offload", case, "actor_back", out["after_reload"] >= out["start"] - 0.1 * out["expected_freed_gib"])
        self.check("offload", case, "weights_unchanged", out["weights_unchanged"])
        self.check("offload", case, "masters_and_moments_unchanged", out["masters_and_moments_unchanged"])
        self.check("offload", case, "step_after_reload_ok", out["step_after_reload_ok"])
        # frozen reference (KL): offload -> reload -> logprobs, twice
        plain = self.model().to(self.dev, dtype=self.dtype)
        ids, mask = self.batches(77)[0]
        with torch.no_grad():
            expect = token_logprobs(plain, ids, mask)[0]
        del plain
        out["ref_before_prepare"] = mem(self.dev)
        ref = strategy.prepare_frozen(self.model(), offload=True)
        out["ref_offloaded"] = mem(self.dev)
        diffs = []
        for _ in range(2):
            strategy.reload_model(ref)
            out["ref_reloaded"] = mem(self.dev)
            with torch.no_grad():
                diffs.append(float((token_logprobs(ref, ids, mask)[0] - expect).abs().max()))
            strategy.offload_model(ref)
        out["ref_offloaded_again"] = mem(self.dev)
        out["ref_logprob_max_abs_diff"] = diffs
        self.res["offload"][case] = out
        self.check("offload", case, "ref_logprobs_match", max(diffs) < 5e-2 and diffs[0] == diffs[1])
        if self.cuda:
            self.check("offload", case, "ref_offload_frees", out["ref_offloaded_again"] <= out["ref_before_prepare"] + 0.01)

    def resume(self, case: str):
        strategy, state = self.trainable(dict(backend="deepspeed", **CASES[case]))
        self.train(strategy, state, 2)
        root = Path(self.tmp) / case
        path = ckpt.save_checkpoint(root, 2, model_states={"actor": strategy.state_dict(state)}, trainer_state={"step": 2},
                                    runtime=self.rt, keep=1)
        ref = self.train(strategy, state, 1, first=2)
        ref_w = dict(strategy.full_weights(state.model, torch.float32))
        strategy2, state2 = self.trainable(dict(backend="deepspeed", **CASES[case]))
        states = {"actor": strategy2.state_dict(state2)}
        ckpt.load_checkpoint(path, model_states=states, rank=self.rt.rank)
        strategy2.load_state_dict(state2, states["actor"])
        got = self.train(strategy2, state2, 1, first=2)
        w = dict(strategy2.full_weights(state2.model, torch.float32))
        out = {"loss": [got[0]["loss"], ref[0]["loss"]], "grad_norm": [got[0]["grad_norm"], ref[0]["grad_norm"]],
               "weights_equal": all(torch.equal(w[n], ref_w[n]) for n in w)}
        self.res["resume"][case] = out
        self.check("resume", case, "loss_equal", out["loss"][0] == out["loss"][1])
        self.check("resume", case, "weights_equal", out["weights_equal"])

    # ---- driver ----------------------------------------------------------------------------------
    def guarded(self, name: str, fn, *args):
        """Run one case; an exception is reported and the next case runs. A rank that fails while
        the others wait in a collective would hang them: the collective timeout (``--hang-s``)
        and the faulthandler watchdog end the run then, with the results so far already written."""
        faulthandler.dump_traceback_later(self.args.hang_s, exit=True)
        try:
            return fn(*args)
        except Exception as e:  # report and go on with the next case
            self.res["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
            self.res["ok"][f"{name}.ran"] = False
            return None
        finally:
            faulthandler.cancel_dump_traceback_later()
            torch.cuda.empty_cache()
            self.write()

    def write(self) -> None:
        if self.rt.is_main and self.args.out:
            Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.out).write_text(json.dumps(self.res, indent=1, default=float))

    def run(self):
        fsdp = get_strategy(StrategyConfig(param_dtype=self.args.param_dtype), self.rt)
        state = fsdp.prepare_trainable(self.model(), OPTIM, lr=OPTIM.lr, total_steps=self.args.steps + 2)
        fsdp_full0 = {n: t.clone() for n, t in fsdp.full_weights(state.model, self.dtype)}
        fsdp_log = self.train(fsdp, state, self.args.steps)
        fsdp_sd = fsdp.full_model_state_dict(state.model)
        self.res["parity"]["fsdp2"] = {"log": fsdp_log, "step_s_mean": sum(x["step_s"] for x in fsdp_log[1:]) / max(1, len(fsdp_log) - 1)}
        del state, fsdp
        gc.collect()
        torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory() as tmp:
            self.tmp = self.rt_shared_dir(tmp)
            for case in self.args.cases:
                got = self.guarded(f"parity.{case}", self.parity, fsdp_log, fsdp_sd, case)
                if got is not None:
                    self.guarded(f"offload.{case}", self.offload, case, *got)
                del got
                torch.cuda.empty_cache()
                self.guarded(f"weight_sync.{case}", self.weight_sync, case, fsdp_full0)
                self.guarded(f"resume.{case}", self.resume, case)
        self.res["all_ok"] = all(self.res["ok"].values())
        return self.res

    def rt_shared_dir(self, tmp: str) -> str:
        """Rank 0's temporary directory, for every rank (one host)."""
        return self.rt.broadcast_object(tmp)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no memory checks)")
    p.add_argument("--param-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--hang-s", type=float, default=300.0, help="collective timeout and per-case watchdog")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args()
    bench = Bench(args)
    res = bench.run()
    bench.write()
    if bench.rt.is_main:
        print(json.dumps(res, indent=1, default=float), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
