"""Supervised warm start of the quickstart model, and a greedy evaluation helper.

The SFT loop is deliberately plain torch: prompt -> answer + EOS, cross-entropy on the answer
tokens only, AdamW with linear warmup (first 10% of steps) then linear decay to zero.
:func:`train_masked` is the same loop over (ids, loss mask) pairs, for multi-turn transcripts whose
loss covers the assistant's turns only (the calculator task).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from tidal.logging.progress import Step
from tidal.tasks.arithmetic import is_correct
from tidal.tasks.tokenizer import prompt_ids

IGNORE = -100


def encode_sft_rows(tokenizer: PreTrainedTokenizerFast, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(ids, num_prompt_tokens) per row: templated prompt ids + reference ids + EOS."""
    out = []
    for row in rows:
        prompt = prompt_ids(tokenizer, row["prompt"])
        answer = tokenizer(row["reference"], add_special_tokens=False)["input_ids"]
        out.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return out


def collate_masked(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids_BT, attention_mask_BT, labels_BT) of (ids, loss_mask) pairs; labels
    are IGNORE where the loss mask is 0 (e.g. the prompt and the observations of a multi-turn
    transcript) and on padding."""
    T = max(len(ids) for ids, _ in examples)
    input_ids_BT = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels_BT = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    mask_BT = torch.zeros((len(examples), T), dtype=torch.long)
    for b, (ids, loss_mask) in enumerate(examples):
        ids_t = torch.tensor(ids)
        input_ids_BT[b, : len(ids)] = ids_t
        labels_BT[b, : len(ids)] = torch.where(torch.tensor(loss_mask, dtype=torch.bool), ids_t, IGNORE)
        mask_BT[b, : len(ids)] = 1
    return input_ids_BT, mask_BT, labels_BT


def _lr_factor(step: int, total: int) -> float:
    warmup = max(1, total // 10)
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def supervised_finetune(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, rows: list[dict], *, steps: int, lr: float, batch_size: int, seed: int,
    description: str = "warm start (SFT)",
) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps on batches drawn (seeded) from ``rows``.
    Returns the loss of every step (mean cross-entropy per answer token)."""
    examples = [(ids, [0] * n + [1] * (len(ids) - n)) for ids, n in encode_sft_rows(tokenizer, rows)]
    return train_masked(model, examples, pad_id=tokenizer.pad_token_id, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                        description=description)


def train_masked(
    model: PreTrainedModel, examples: list[tuple[list[int], list[int]]], *, pad_id: int, steps: int, lr: float, batch_size: int, seed: int,
    description: str = "warm start (SFT)",
) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps (linear warmup over 10%, then linear decay
    to zero) on batches drawn (seeded) from (ids, loss_mask) ``examples``; the loss is the mean
    cross-entropy over the tokens whose mask is 1. Returns the loss of every step. Its progress is
    shown as ``description`` (:mod:`tidal.logging.progress`)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps))
    model.train()
    losses = []
    with Step(description, total=steps, unit="steps") as shown:
        for _ in range(steps):
            losses.append(_sft_step(model, examples, gen, opt, sched, pad_id=pad_id, batch_size=batch_size))
            shown.advance(info=f"loss {losses[-1]:.3f}")
    model.eval()
    return losses


def _sft_step(model, examples, gen, opt, sched, *, pad_id: int, batch_size: int) -> float:
    """One AdamW step on a batch drawn from ``examples``; returns its loss."""
    idx = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
    input_ids_BT, mask_BT, labels_BT = collate_masked([examples[i] for i in idx], pad_id)
    loss = model(input_ids=input_ids_BT, attention_mask=mask_BT, labels=labels_BT, use_cache=False).loss  # no cache to fill
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


@torch.no_grad()
def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    n: int = 1,
    batch_size: int = 256,
) -> list[str]:
    """Decoded responses (special tokens skipped) of HF ``generate``, prompt-major (n per prompt).
    temperature 0 is greedy; otherwise plain sampling at that temperature (no top-k/top-p)."""
    out = []
    for start in range(0, len(prompts), batch_size):
        encoded = [prompt_ids(tokenizer, p) for p in prompts[start : start + batch_size]]
        T = max(len(ids) for ids in encoded)
        input_ids_BT = torch.tensor([[tokenizer.pad_token_id] * (T - len(ids)) + ids for ids in encoded])
        mask_BT = (torch.arange(T)[None, :] >= torch.tensor([T - len(ids) for ids in encoded])[:, None]).long()
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        seqs_BT = model.generate(
            input_ids=input_ids_BT,
            attention_mask=mask_BT,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
        out += tokenizer.batch_decode(seqs_BT[:, T:], skip_special_tokens=True)
    return out


def max_answer_tokens(rows: list[dict]) -> int:
    """Enough new tokens for the longest reference, a leading zero or sign, EOS and one spare."""
    return max(len(row["reference"]) for row in rows) + 3


def evaluate_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, rows: list[dict]) -> float:
    """Fraction of ``rows`` whose greedy response is correct under :func:`tidal.tasks.arithmetic.is_correct`."""
    responses = generate_responses(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=max_answer_tokens(rows))
    return sum(is_correct(resp, row["reference"]) for resp, row in zip(responses, rows)) / len(rows)
