"""Multi-turn environments and tools; trajectories as exact token sequences (single-turn = one turn).

See docs/agentic.md. The pieces: :class:`EnvConfig` (``env.*``); :class:`Environment` with
``reset``/``step`` and the registry; :class:`ChatRenderer` (observations rendered by the chat
template and appended, never re-encoding a turn); tool calls in the Qwen2.5/Qwen3 format
(:mod:`tidal.envs.tool_calls`), tools with per-call limits (:mod:`tidal.envs.tools`) and a
sandboxed Python tool (:mod:`tidal.envs.sandbox`); :class:`TrajectoryBuilder` and
:func:`pack_trajectories`; :class:`EnvRollout`, the rollout loop over an engine's ``generate``.
"""

from tidal.lazy import lazy_exports

_WHERE = {
    "ENVIRONMENTS": "tidal.envs.registry",
    "ChatRenderer": "tidal.envs.chat",
    "EnvConfig": "tidal.envs.config",
    "EnvError": "tidal.envs.rollout",
    "EnvRollout": "tidal.envs.rollout",
    "make_rollout": "tidal.envs.rollout",
    "EnvRow": "tidal.envs.base",
    "Environment": "tidal.envs.base",
    "ModelTurn": "tidal.envs.base",
    "Observation": "tidal.envs.base",
    "PackedRows": "tidal.envs.packing",
    "RolloutResult": "tidal.envs.rollout",
    "SandboxConfig": "tidal.envs.config",
    "StepResult": "tidal.envs.base",
    "TemplateError": "tidal.envs.chat",
    "Trajectory": "tidal.envs.trajectory",
    "TrajectoryBuilder": "tidal.envs.trajectory",
    "make_env_factory": "tidal.envs.base",
    "pack_trajectories": "tidal.envs.packing",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
