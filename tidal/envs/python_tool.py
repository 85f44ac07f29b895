"""``python``: math word problems (GSM8K, MATH) with a sandboxed Python tool.

The model may run code (:class:`~tidal.envs.sandbox.PythonTool`, limits in ``env.sandbox.*``)
any number of turns, then answers without a tool call; the RewardEngine scores that final answer
(e.g. the ``math_answer`` rule on ``\\boxed{...}``). Building the environment checks once that the
sandbox can be created here and raises :class:`~tidal.envs.sandbox.SandboxError` if not.
"""

from __future__ import annotations

from tidal.envs.sandbox import PythonSandbox, PythonTool
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import Tool

SYSTEM_PROMPT = (
    "Solve the problem step by step. You can run Python code with the python tool to calculate; "
    "it returns what the code prints. When you are done, give the final answer in \\boxed{}."
)


class PythonToolEnv(ToolEnv):
    name = "python"
    default_system_prompt = SYSTEM_PROMPT

    def make_tools(self) -> list[Tool]:
        return [PythonTool(PythonSandbox(self.cfg.sandbox))]
