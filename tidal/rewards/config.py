"""Configuration of the reward layer (``reward.*``).

A run names its reward *components* (each a rule, a Python function, a local reward model or a
remote reward service, with that type's own settings) and *recipes*: a recipe label maps to a list
of ``(component, weight)``. A data row's ``label`` picks its recipe; rows without a label use
``default_recipe``. The total reward of a sample is ``sum(weight * component_score)`` over its recipe.

Each component's settings are validated by the kw-only dataclass of its type (``FunctionRewardConfig``,
``ModelRewardConfig``, ``RemoteRewardConfig`` or the rule's own config), so an error names the full
key, e.g. ``reward.components.correct.timeout_s``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal

from tidal.config_base import ConfigError, build, check, check_choice
from tidal.rewards.rules import RULES

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_RESERVED_NAMES = ("total", "dropped", "valid")


@dataclasses.dataclass(kw_only=True)
class FunctionRewardConfig:
    """``type: function``: a Python reward function.

    path: ``"package.module:function"`` (or ``"package.module.function"``). The function takes one
        :class:`~tidal.rewards.types.RewardSample` and returns a number (``def`` or ``async def``).
        A function with the attribute ``batched = True`` takes ``list[RewardSample]`` and returns
        ``list[number]`` of the same length.
    timeout_s: limit of one call (one sample; one whole call for a batched function). A timed-out
        call is an error of that sample (see ``reward.on_error``), counted in ``reward/<name>/timeouts_count``.
    concurrency: calls of this function in flight at once (threads for ``def``, tasks for
        ``async def``; worker processes with ``isolation: process``).
    isolation: where calls run. ``thread``: in the trainer's process (``async def`` on the reward
        event loop, ``def`` on a thread per call; a ``def`` call past its limit is given up on but
        keeps running in the background, and while ``concurrency`` such calls run no new one starts:
        its samples are errors). ``process``: in a pool of ``concurrency`` worker processes;
        a call past its limit is killed and its worker replaced (costs a pickling round trip per call).
    """

    path: str
    timeout_s: float = 30.0
    concurrency: int = 8
    isolation: Literal["thread", "process"] = "thread"

    def __post_init__(self):
        check(bool(self.path.strip()), "path", "must name a function as 'module:function'")
        check(self.timeout_s > 0, "timeout_s", "must be > 0")
        check(self.concurrency >= 1, "concurrency", "must be >= 1")
        check_choice(self.isolation, ("thread", "process"), "isolation")


@dataclasses.dataclass(kw_only=True)
class ModelRewardConfig:
    """``type: model``: a local Hugging Face sequence-classification reward model (``num_labels == 1``).

    path: local directory of the model (``save_pretrained`` layout); never downloaded.
    tokenizer: local directory of its tokenizer (default: ``path``).
    micro_batch_size: sequences per forward pass.
    max_length: tokens per scored sequence; longer ones keep their END (the response) and lose the
        start of the prompt.
    dtype: ``auto`` is bfloat16 on CUDA and float32 elsewhere.
    separator: text put between the prompt text and the response text before tokenising with the
        reward model's own tokenizer. Unset (null): the separator recorded in the folder by Tidal's
        reward-model training (``tidal_reward_format.json``), else ``""``; set, it must equal the
        recorded one.
    """

    path: str
    tokenizer: str | None = None
    micro_batch_size: int = 8
    max_length: int = 4096
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    separator: str | None = None

    def __post_init__(self):
        check(bool(self.path.strip()), "path", "must be a local model directory")
        check(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        check(self.max_length >= 2, "max_length", "must be >= 2")


@dataclasses.dataclass(kw_only=True)
class RemoteRewardConfig:
    """``type: remote``: a reward service speaking Tidal's JSON API v1 (``tidal serve-reward``).

    url: base URL of the service, e.g. ``http://127.0.0.1:8000`` (requests go to ``<url>/v1/score``).
    batch_size: samples per request. concurrency: requests in flight at once.
    timeout_s: limit of one request attempt.
    max_retries: further attempts after a timeout, a connection error, or HTTP 408/500/502/504.
    backoff_s / max_backoff_s: the wait before retry k is ``min(max_backoff_s, backoff_s * 2**k)``
        (jittered to 50-100%); a numeric ``Retry-After`` header is honoured up to ``max_backoff_s``
        (jittered to 100-150% of it).
    retry_deadline_s: how long a batch keeps coming back to a busy server (HTTP 503 or 429, after
        its ``Retry-After``), from its first attempt; those waits are not retries. ``batch_size`` and
        ``concurrency`` are lowered to the server's advertised ``max_batch_size`` and ``max_in_flight``.
    token_env: name of the environment variable that holds the bearer token (the token itself is
        never written into configs); unset means no ``Authorization`` header.
    """

    url: str
    batch_size: int = 32
    concurrency: int = 4
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    retry_deadline_s: float = 300.0
    token_env: str | None = None

    def __post_init__(self):
        check(self.url.startswith(("http://", "https://")), "url", "must start with http:// or https://")
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.concurrency >= 1, "concurrency", "must be >= 1")
        check(self.timeout_s > 0, "timeout_s", "must be > 0")
        check(self.max_retries >= 0, "max_retries", "must be >= 0")
        check(self.backoff_s >= 0, "backoff_s", "must be >= 0")
        check(self.max_backoff_s >= self.backoff_s, "max_backoff_s", "must be >= backoff_s")
        check(0 <= self.retry_deadline_s < math.inf, "retry_deadline_s", "must be >= 0 seconds and finite")
        check(self.token_env is None or bool(self.token_env), "token_env", "must be a variable name or null")

    @property
    def score_url(self) -> str:
        return self.url.rstrip("/") + "/v1/score"


_TYPED = {"function": FunctionRewardConfig, "model": ModelRewardConfig, "remote": RemoteRewardConfig}


@dataclasses.dataclass(kw_only=True, frozen=True)
class ComponentSpec:
    """One validated component: ``type`` is function/model/remote/rule; ``rule`` names the rule
    (type rule only); ``settings`` is the type's (or the rule's) config dataclass."""

    name: str
    type: str
    settings: Any
    rule: str | None = None


def parse_component(name: str, spec: Any, key: str) -> ComponentSpec:
    """Validate one ``reward.components.<name>`` mapping into a :class:`ComponentSpec`.

    ``{type: rule, rule: R, ...}`` and the shorthand ``{type: R, ...}`` are the same rule component;
    the remaining keys are the rule's settings.
    """
    check(isinstance(spec, dict), key, f"expected a mapping with a 'type', got {spec!r}")
    rest = dict(spec)
    kind = rest.pop("type", None)
    check(isinstance(kind, str), f"{key}.type", f"required; one of {sorted(_TYPED) + ['rule'] + RULES.names()}")
    if kind in _TYPED:
        return ComponentSpec(name=name, type=kind, settings=build(_TYPED[kind], rest, prefix=key))
    if kind == "rule":
        rule = rest.pop("rule", None)
        check(isinstance(rule, str), f"{key}.rule", f"required for type rule; one of {RULES.names()}")
        rule_key = f"{key}.rule"
    else:
        rule, rule_key = kind, f"{key}.type"
    if rule not in RULES.names():
        check_choice(kind, sorted(_TYPED) + ["rule"] + RULES.names(), f"{key}.type")
    rule_cls = RULES.get(rule, rule_key)
    return ComponentSpec(name=name, type="rule", rule=rule, settings=build(rule_cls.Config, rest, prefix=key))


def parse_recipe(value: Any, key: str) -> list[tuple[str, float]]:
    """A recipe is a list of ``[component, weight]`` pairs, or a mapping ``{component: weight}``."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    check(isinstance(pairs, (list, tuple)) and len(pairs) > 0, key, "expected a non-empty list of [component, weight]")
    out: list[tuple[str, float]] = []
    for i, pair in enumerate(pairs):
        item_key = f"{key}[{i}]"
        check(isinstance(pair, (list, tuple)) and len(pair) == 2, item_key, f"expected [component, weight], got {pair!r}")
        comp, weight = pair
        check(isinstance(comp, str), item_key, f"component name must be a string, got {comp!r}")
        check(isinstance(weight, (int, float)) and not isinstance(weight, bool), item_key, f"weight must be a number, got {weight!r}")
        check(math.isfinite(weight), item_key, "weight must be finite")
        check(comp not in [c for c, _ in out], item_key, f"component '{comp}' appears twice in this recipe")
        out.append((comp, float(weight)))
    return out


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
    """Reward settings (``reward.*``).

    components: name -> component mapping with a ``type`` (``function``, ``model``, ``remote``,
        ``rule`` with ``rule: <name>``, or a rule name directly) and that type's settings.
        Names become metric names (``reward/<name>``): letters, digits, ``_ . -``.
    recipes: label -> ``[[component, weight], ...]`` (or ``{component: weight}``). Every component
        must be used by some recipe, and every recipe entry must name a component.
    default_recipe: the recipe of rows whose label is empty. ``null`` (default): the recipe named
        ``default`` when there is one, else the only recipe when there is exactly one; with several
        recipes and none named ``default``, an unlabelled row is an error naming the sample. A name
        must be one of ``recipes``. The recipe it resolves to is :attr:`unlabelled_recipe`.
    on_error: what a failed component does to a sample (a raising or timed-out function, a remote
        request that failed after its retries, a NaN, infinite, beyond-float32 or non-number score):
        ``raise`` stops the step with an error naming the component and the sample; ``drop`` marks
        the sample invalid (``valid_B`` False, total 0, excluded from training) and counts it in
        ``reward/dropped_count``. Nothing is ever silently scored 0.
    timeout_s: deadline of one scoring call for its function and remote components together, so
        that scoring can never hang training. Past it the call stops waiting: every sample of a
        component that has not answered is an error of that component (``on_error``), and
        ``reward/deadline_exceeded_max`` is 1. ``null`` (default) derives it from the components' own
        limits -- the longest their ``timeout_s``, ``concurrency``, retries and backoff allow for
        the call's sample count, plus a minute -- so it fires only when a component breaks its own
        limits (an ``async def`` function that blocks the event loop, a wedged connection). A
        number caps the whole call instead. (Rules and local reward models run on the caller's
        thread and are not covered: ``math_answer`` has its own ``timeout_s``.)

    An empty ``components`` mapping is a valid config meaning "no rewards configured";
    :class:`~tidal.rewards.engine.RewardEngine` refuses it.
    """

    components: dict[str, Any] = dataclasses.field(default_factory=dict)
    recipes: dict[str, Any] = dataclasses.field(default_factory=dict)
    default_recipe: str | None = None
    on_error: Literal["raise", "drop"] = "raise"
    timeout_s: float | None = None

    specs: dict[str, ComponentSpec] = dataclasses.field(init=False, repr=False, compare=False)
    recipe_weights: dict[str, list[tuple[str, float]]] = dataclasses.field(init=False, repr=False, compare=False)
    unlabelled_recipe: str | None = dataclasses.field(init=False, repr=False, compare=False)
    _rules: dict[str, Any] = dataclasses.field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self):
        check_choice(self.on_error, ("raise", "drop"), "on_error")
        check(self.timeout_s is None or self.timeout_s > 0, "timeout_s", "must be > 0 seconds, or null (derived)")
        specs = {}
        for name, spec in self.components.items():
            key = f"components.{name}"
            check(isinstance(name, str) and bool(_NAME_RE.match(name)), key, "name must use letters, digits, '_', '.', '-'")
            check(name not in _RESERVED_NAMES, key, f"name is reserved ({list(_RESERVED_NAMES)})")
            specs[name] = parse_component(name, spec, key)
        recipes = {str(label): parse_recipe(value, f"recipes.{label}") for label, value in self.recipes.items()}
        self._check_references(specs, recipes)
        self.specs = specs
        self.recipe_weights = recipes
        self.unlabelled_recipe = self._resolve_default(recipes)

    @property
    def judges_correctness(self) -> bool:
        """True when every component is a rule or a function (a right/wrong judgement that a
        threshold on the total reward turns into accuracy); False when a reward model or a remote
        service scores (a preference score: evaluation reports the mean reward only)."""
        return all(spec.type in ("rule", "function") for spec in self.specs.values())
    def recipe_problem(self, label: str) -> str | None:
        """Why a row labelled ``label`` ("" for none) has no recipe; None when it has one (the same
        rule for the check before a run and the scoring in it)."""
        if not label and self.unlabelled_recipe is None:
            return (f"has no label, and with several recipes ({sorted(self.recipe_weights)}) and none named 'default' it "
                    "has no recipe: label the row or set reward.default_recipe")
        if label and label not in self.recipe_weights:
            return f"has label '{label}', which is not a recipe; recipes: {sorted(self.recipe_weights)}"
        return None

    def check_row(self, where: str, label: str, reference: Any) -> None:
        """A data row's ``label`` names a recipe, and every rule of that recipe that reads answers
        can use the row's ``reference`` (:meth:`~tidal.rewards.rules.RuleReward.reference_problem`).
        ConfigError naming the row, the key and the fix; nothing to check without components."""
        if not self.specs:
            return
        problem = self.recipe_problem(label)
        if problem is not None:
            fix = ("rename the recipe in reward.recipes to the data's label, or set data.label_key to the field that "
                   "holds recipe names") if label else "label the rows (data.label_key) or set reward.default_recipe"
            raise ConfigError("reward.recipes", f"{where}: the row {problem}; {fix}")
        for name, _weight in self.recipe_weights[label or self.unlabelled_recipe]:
            rule = self._rule(name)
            problem = rule.reference_problem(reference) if rule is not None else None
            if problem is not None:
                raise ConfigError(f"reward.components.{name}", f"{where}: {problem}")

    def _rule(self, name: str):
        """The rule object of component ``name`` (built once), or None for another type."""
        spec = self.specs[name]
        if spec.type != "rule":
            return None
        if name not in self._rules:
            self._rules[name] = RULES.get(spec.rule, f"reward.components.{name}.rule")(spec.settings)
        return self._rules[name]

    def _resolve_default(self, recipes: dict) -> str | None:
        if self.default_recipe is not None:
            return self.default_recipe
        if "default" in recipes:
            return "default"
        return next(iter(recipes)) if len(recipes) == 1 else None

    def _check_references(self, specs: dict[str, ComponentSpec], recipes: dict[str, list[tuple[str, float]]]) -> None:
        if not specs:
            check(not recipes, "recipes", "recipes given but reward.components is empty")
            return
        check(bool(recipes), "recipes", "at least one recipe is required when components are configured")
        for label, pairs in recipes.items():
            for i, (comp, _w) in enumerate(pairs):
                check(comp in specs, f"recipes.{label}[{i}]", f"unknown component '{comp}'; defined: {sorted(specs)}")
        used = {comp for pairs in recipes.values() for comp, _w in pairs}
        for name in specs:
            check(name in used, f"components.{name}", "defined but used by no recipe")
        if self.default_recipe is not None:
            check(self.default_recipe in recipes, "default_recipe", f"'{self.default_recipe}' is not a recipe; recipes: {sorted(recipes)}")
