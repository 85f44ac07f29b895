"""Multi-turn environments and tools; trajectories as exact token sequences (single-turn = one turn).

See docs/agentic.md. The pieces: :class:`EnvConfig` (``env.*``); :class:`Environment` with
``reset``/``step`` and the registry; :class:`ChatRenderer` (observations rendered by the chat
template and appended, never re-encoding a turn); tool calls in the Qwen2.5/Qwen3 format
(:mod:`tidal.envs.tool_calls`), tools with per-call limits (:mod:`tidal.envs.tools`) and a
sandboxed Python tool (:mod:`tidal.envs.sandbox`); :class:`TrajectoryBuilder` and
:func:`pack_trajectories`; :class:`EnvRollout`, the rollout loop over an engine's ``generate``.
"""

from tidal.envs.base import EnvRow, Environment, ModelTurn, Observation, StepResult, make_env_factory
from tidal.envs.chat import ChatRenderer, TemplateError
from tidal.envs.config import EnvConfig, SandboxConfig
from tidal.envs.packing import PackedRows, pack_trajectories
from tidal.envs.registry import ENVIRONMENTS
from tidal.envs.rollout import EnvError, EnvRollout, RolloutResult
from tidal.envs.trajectory import Trajectory, TrajectoryBuilder

__all__ = [
    "ENVIRONMENTS", "ChatRenderer", "EnvConfig", "EnvError", "EnvRollout", "EnvRow", "Environment", "ModelTurn",
    "Observation", "PackedRows", "RolloutResult", "SandboxConfig", "StepResult", "TemplateError", "Trajectory",
    "TrajectoryBuilder", "make_env_factory", "pack_trajectories",
]
