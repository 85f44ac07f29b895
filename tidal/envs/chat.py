"""Rendering observations into tokens with the model's chat template, without re-encoding history.

The model's turns are never re-encoded: after a turn, only the NEW messages (tool results, user
feedback) are rendered and their tokens appended. The template decides what goes between the end
of the assistant's content and the next generation prompt (Qwen2.5: ``<|im_end|>\\n<|im_start|>
user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``), so that
text is taken from the template itself: the template renders a fixed stand-in conversation whose
assistant content is a sentinel, followed by the new messages and the generation prompt, and the
text after the sentinel is what follows a turn. If the model's turn ended on the stop token that
opens that text (``<|im_end|>``), that token is already in the trajectory and is not appended
again; a turn cut at its length limit gets the template's whole closing.

Earlier turns of the stand-in conversation may be rendered differently by templates that rewrite
history (Qwen3 drops the ``<think>`` of earlier turns): that never matters here, since only the
text after the sentinel is used.
"""

from __future__ import annotations

from typing import Any

from tidal.envs.base import Message, ModelTurn

# Assistant content of the stand-in conversation; nothing in a chat template contains it.
_SENTINEL = "\u2063tidal-turn-end\u2063"
_STAND_IN = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]


class TemplateError(ValueError):
    """The chat template cannot render what was asked (no template, tool messages unsupported)."""


class ChatRenderer:
    """Chat-template rendering of prompts and observations for one tokenizer.

    template_kwargs: extra template variables (``env.chat_template_kwargs``, e.g. enable_thinking).
    Rendering needs the tokenizer's chat template (TemplateError without one); encoding and
    decoding do not.
    """

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer
        self.template_kwargs = dict(template_kwargs or {})

    # ---- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as is (no special tokens added; special-token text is recognised)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        """The text of sampled ids, special tokens skipped (as the reward sees a response)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def decode_batch(self, token_ids: list[list[int]]) -> list[str]:
        """:meth:`decode` of many (one call: a fast tokenizer decodes the batch natively)."""
        return self.tokenizer.batch_decode(token_ids, skip_special_tokens=True) if token_ids else []

    def render(self, messages: list[Message], *, tools: list[dict] | None = None, generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; chat observations are rendered with it")
        kwargs = dict(self.template_kwargs)
        if tools is not None:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)

    # ---- what the engine sees ------------------------------------------------------------------
    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Ids of a whole conversation rendered with the generation prompt (a first observation, or
        a re-rendered history with ``env.history: template``)."""
        if not messages:
            raise TemplateError("a prompt needs at least one message")
        return self.encode(self.render(messages, tools=tools))

    def observation_text(self, messages: list[Message]) -> str:
        """The template's text after an assistant turn's content: its closing, the rendering of
        ``messages``, and the generation prompt."""
        text = self.render(_STAND_IN + list(messages))
        i = text.rfind(_SENTINEL)
        if i < 0 or text.count(_SENTINEL) != 1:
            raise TemplateError("the chat template does not render an assistant message's content verbatim; "
                                "observations cannot be rendered without re-encoding the turn")
        return text[i + len(_SENTINEL):]

    def defuse(self, text: str) -> str:
        """``text`` with every special-token string (``<|im_end|>``, ``<|im_start|>``, ...) broken by a
        zero-width space after its first character, so that content from a tool or a user cannot
        encode to control tokens and forge turns."""
        for special in self._special_strings():
            if special in text:
                text = text.replace(special, special[0] + "\u200b" + special[1:])
        return text

    def _special_strings(self) -> list[str]:
        names = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        names |= {t.content for t in decoder.values() if getattr(t, "special", False)}
        return sorted((n for n in names if len(n) > 1), key=len, reverse=True)

    def observation_ids(self, messages: list[Message], turn: ModelTurn) -> list[int]:
        """Ids to append after ``turn``: the template's closing of the assistant turn (without the
        stop token when the turn ended on exactly the token that closing starts with), ``messages``
        (their string contents defused, see :meth:`defuse`), and the generation prompt."""
        messages = [dict(m, content=self.defuse(m["content"])) if isinstance(m.get("content"), str) else m for m in messages]
        ids = self.encode(self.observation_text(messages))
        if turn.finish_reason == "stop" and turn.token_ids and ids and ids[0] == turn.token_ids[-1]:
            ids = ids[1:]
        return ids

    def check_tool_messages(self) -> None:
        """Raise TemplateError unless the template renders ``tool`` messages as Qwen2.5/Qwen3 do
        (inside ``<tool_response>`` tags), which the tool-calling helpers follow."""
        try:
            text = self.observation_text([{"role": "tool", "content": "x"}])
        except Exception as e:  # a template that raises on the tool role
            raise TemplateError(f"the chat template cannot render a 'tool' message: {type(e).__name__}: {e}") from e
        if "<tool_response>" not in text:
            raise TemplateError("the chat template does not render 'tool' messages inside <tool_response> tags; "
                                "the tool helpers follow the Qwen2.5 / Qwen3 templates (use such a model or template)")
