"""The decode floor of a model with sliding-window layers (issue 50 item 3): a decode step reads a
window layer's KV only within its window, which is what the native engine's window pool keeps."""

from bench.grpo import shapes

GEMMA = dict(model_type="gemma3_text", hidden_size=8, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
             head_dim=4, intermediate_size=16, vocab_size=8, sliding_window=8,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])


def test_window_layers_read_at_most_their_window():
    # one layer's K and V of a token: 2 x 1 head x 4 dims x 2 bytes = 16 bytes
    assert shapes.kv_bytes_per_token(GEMMA) == 4 * 16
    # 5 tokens: all four layers hold them; 20 tokens: the full layer 20, each window layer 8
    assert shapes.kv_bytes_per_sequence(GEMMA, [5, 8, 20]).tolist() == [4 * 5 * 16, 4 * 8 * 16, (20 + 3 * 8) * 16]
    assert shapes.attended_tokens(GEMMA, [5, 20]).tolist() == [4 * 5, 20 + 3 * 8]
    # without windows (the same shape as Qwen2 declares it): every layer every token
    dense = {k: v for k, v in GEMMA.items() if k not in ("model_type", "layer_types", "sliding_window")}
    assert shapes.kv_bytes_per_sequence(dense, [20]).tolist() == [4 * 20 * 16]
