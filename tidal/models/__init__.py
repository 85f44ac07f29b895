from tidal.lazy import lazy_exports

_WHERE = {
    "load_causal_lm": "tidal.models.loading",
    "load_critic": "tidal.models.loading",
    "load_tokenizer": "tidal.models.loading",
    "critic_values": "tidal.models.loading",
    "attach_logprob_method": "tidal.models.logprobs",
    "lm_head_logprobs": "tidal.models.lm_head",
    "token_logprobs": "tidal.models.logprobs",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
