from tidal.models.loading import critic_values, load_causal_lm, load_critic, load_tokenizer
from tidal.models.logprobs import attach_logprob_method, lm_head_logprobs, token_logprobs

__all__ = ["load_causal_lm", "load_critic", "load_tokenizer", "critic_values", "attach_logprob_method", "lm_head_logprobs", "token_logprobs"]
