"""Packing: the real-token micro-batch planner, bucketed packed lengths, the packed layout and the
varlen attention reference (hand-computed values and per-sequence SDPA)."""

import pytest
import torch
import torch.nn.functional as F

from tidal.models.packing import MIN_BUCKET, PackedBatch, bucket_tokens
from tidal.models.varlen import reference_varlen_attention, sequence_ids, varlen_attention
from tidal.trainer.experience import packed_micro_batches


# ---- planner -------------------------------------------------------------------------------------
def test_first_fit_decreasing_fills_micro_batches_by_real_tokens():
    lengths = [6, 1, 4, 3, 5, 2]  # 21 tokens, budget 7: the optimum is 3 full micro-batches
    bins = packed_micro_batches(lengths, max_tokens=7, max_seqs=8)
    # longest first: 6 | 5 | 4 (new micro-batches), then 3 joins 4, 2 joins 5, 1 joins 6
    assert bins == [[0, 1], [4, 5], [2, 3]]
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 7 for b in bins)


def test_planner_is_deterministic_and_respects_both_limits():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 300, (200,), generator=g).tolist()
    for max_seqs in (6, 64):
        bins = packed_micro_batches(lengths, max_tokens=1024, max_seqs=max_seqs)
        assert bins == packed_micro_batches(list(lengths), max_tokens=1024, max_seqs=max_seqs)
        assert sorted(i for b in bins for i in b) == list(range(200))
        assert all(sum(lengths[i] for i in b) <= 1024 and len(b) <= max_seqs for b in bins)
    # bound by tokens, nearly every micro-batch is full: within one of the lower bound
    assert len(bins) <= -(-sum(lengths) // 1024) + 1


def test_a_sequence_longer_than_the_budget_names_the_setting():
    with pytest.raises(ValueError, match=r"sequence 1 has 9 tokens, more than train.forward_micro_batch_tokens=8"):
        packed_micro_batches([3, 9, 2], max_tokens=8, max_seqs=4, setting="train.forward_micro_batch_tokens")


# ---- bucketed lengths ------------------------------------------------------------------------------
def test_bucket_sizes_are_few_and_close():
    sizes = {bucket_tokens(n) for n in range(1, 1 << 16)}
    assert len(sizes) <= 16 * 10 + 1  # 16 per power of two above MIN_BUCKET
    for n in [1, 127, 128, 129, 1000, 4096, 4097, 16000, 60000]:
        b = bucket_tokens(n)
        assert n <= b <= max(MIN_BUCKET, n * (1 + 1 / 16) + 1), (n, b)
    assert bucket_tokens(16000) == 16384 and bucket_tokens(4097) == 4352 and bucket_tokens(100) == MIN_BUCKET
    # the micro-batch budget caps the rounding, never below the real tokens
    assert bucket_tokens(16000, cap=16100) == 16100 and bucket_tokens(100, cap=50) == 100


# ---- layout --------------------------------------------------------------------------------------------
def _padded(lengths, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * am, am


def test_packed_layout_by_hand():
    ids, am = _padded([3, 1, 2])
    act = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 1, 0]])  # row 1's only token is its first: no target
    pb = PackedBatch.build(ids, am, targets_BT=act, pad_id=0, bucket=False)
    assert pb.input_ids_1N.tolist() == [[ids[0, 0], ids[0, 1], ids[0, 2], ids[1, 0], ids[2, 0], ids[2, 1]]]
    assert pb.position_ids_1N.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert pb.cu_seqlens.tolist() == [0, 3, 4, 6] and pb.cu_seqlens.dtype == torch.int32
    assert pb.max_seqlen == 3 and pb.num_real == pb.num_tokens == 6
    assert pb.source_M.tolist() == [0, 1, 2, 3, 6, 7]
    assert pb.targets_K.tolist() == [1, 2, 5]  # packed positions; each predicted by the one before it
    assert pb.target_source_K.tolist() == [1, 2, 7]
    x_BT = torch.arange(9.0).view(3, 3)
    assert pb.pack(x_BT).tolist() == [0, 1, 2, 3, 6, 7]
    assert pb.scatter_targets(torch.tensor([10.0, 20.0, 30.0])).tolist() == [[0, 10, 20], [0, 0, 0], [0, 30, 0]]


def test_bucket_padding_is_a_dummy_sequence_of_its_own():
    ids, am = _padded([5, 7])
    pb = PackedBatch.build(ids, am, pad_id=0)  # no targets given: every real token but the rows' first
    assert pb.num_tokens == MIN_BUCKET and pb.num_real == 12
    assert pb.cu_seqlens.tolist() == [0, 5, 12, MIN_BUCKET] and pb.max_seqlen == MIN_BUCKET - 12
    assert pb.position_ids_1N[0, 12:].tolist() == list(range(MIN_BUCKET - 12))
    assert (pb.input_ids_1N[0, 12:] == 0).all()
    assert pb.targets_K.tolist() == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert pb.pack(torch.ones(2, 7), fill=-1)[12:].eq(-1).all()


def test_rows_must_be_right_padded_and_non_empty():
    ids, am = _padded([3, 2])
    left = am.flip(-1)
    with pytest.raises(ValueError, match="right-padded"):
        PackedBatch.build(ids, left)
    am[1] = 0
    with pytest.raises(ValueError, match="at least one real token"):
        PackedBatch.build(ids, am)


# ---- attention -----------------------------------------------------------------------------------------
def test_sequence_ids_from_boundaries():
    assert sequence_ids(torch.tensor([0, 3, 4, 6], dtype=torch.int32), 6).tolist() == [0, 0, 0, 1, 2, 2]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_reference_varlen_attention_equals_each_sequence_alone(causal, heads, kv_heads):
    g = torch.Generator().manual_seed(1)
    lens, D = [5, 1, 9, 3], 8
    N = sum(lens)
    q, k, v = torch.randn(N, heads, D, generator=g), torch.randn(N, kv_heads, D, generator=g), torch.randn(N, kv_heads, D, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, max(lens), causal=causal)  # CPU: the reference
    torch.testing.assert_close(out, reference_varlen_attention(q, k, v, cu, causal=causal))
    for s in range(len(lens)):
        a, b = cu[s], cu[s + 1]
        want = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=causal, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[a:b], want, atol=1e-6, rtol=1e-5)
