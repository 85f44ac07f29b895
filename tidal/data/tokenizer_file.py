"""A model folder's tokenizer read with the ``tokenizers`` library and ``jinja2`` alone (no torch, no
transformers): what ``tidal check`` needs to count a prompt's tokens in a fraction of a second.

Contract: :func:`load_tokenizer_file` returns a :class:`TokenizerFile` that renders a chat with the
folder's chat template and tokenizes text as transformers' fast tokenizer of the same folder does
(``tokenizer.json``; the template from ``chat_template.jinja`` or ``tokenizer_config.json``, rendered
in a sandboxed jinja2 environment set up as transformers sets up its own: ``trim_blocks``,
``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``, the
special tokens as variables; ``tests/unit/test_tokenizer_file.py`` holds them equal). It returns None
where it cannot promise that (no ``tokenizer.json``, a vision-language folder's processor, a
tokenizer_config.json that asks transformers to change the special tokens it adds); the caller then
uses the full tokenizer (:func:`tidal.models.loading.load_tokenizer`), which the run loads anyway.
What it does not know: padding, images, the model's vocabulary size.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys by which transformers rebuilds the post-processor (the special tokens
# added around a text): the file's own post-processor would then not be the one used
_POST_PROCESSOR_KEYS = ("add_bos_token", "add_eos_token")


class TokenizerFile:
    """Tokenizes text and renders chats like the folder's transformers tokenizer (see module docstring)."""

    def __init__(self, tokenizer: Any, chat_template: str | None, special: dict[str, Any]):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self._special = special
        self._compiled = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = False, tokenize: bool = False) -> str:
        if tokenize:
            raise ValueError("TokenizerFile.apply_chat_template renders text only (tokenize=False)")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._special)


def load_tokenizer_file(path: str) -> TokenizerFile | None:
    """The tokenizer of model folder ``path`` without transformers, or None where only transformers'
    loading gives the run's tokenizer (see module docstring)."""
    tok_json, config_path = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(tok_json) or os.path.exists(os.path.join(path, "preprocessor_config.json")):
        return None
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or any(k in config for k in _POST_PROCESSOR_KEYS):
        return None
    template = _chat_template(path, config)
    if template is False:
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(tok_json)
    except Exception:  # noqa: BLE001 -- a file tokenizers cannot read: transformers' loading says what is wrong
        return None
    special = {k: _content(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
    if "pad_token" not in special and "eos_token" in special:
        special["pad_token"] = special["eos_token"]  # what tidal.models.loading.load_tokenizer sets
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    if isinstance(extra, list):
        special["additional_special_tokens"] = [_content(t) for t in extra]
    return TokenizerFile(tokenizer, template, special)


def _content(token: Any) -> Any:
    """A special token's text (tokenizer_config.json writes a plain string or an AddedToken dict)."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(path: str, config: dict) -> str | None | bool:
    """The folder's chat template as transformers reads it (``chat_template.jinja`` first), None when
    it has none, False when it keeps several named ones (their choice is transformers')."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    if os.path.isdir(os.path.join(path, "additional_chat_templates")):
        return False
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    return False


def _compile(template: str):
    """``template`` compiled in a sandbox set up as transformers' ``_compile_jinja_template``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers' assistant-mask marker, rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("render_body"), [], [], body).set_lineno(lineno)

        def render_body(self, caller):  # called by name from the compiled template (call_method above)
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
