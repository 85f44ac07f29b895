"""Environments from the ecosystem, each behind an optional extra imported only when used
(docs/agentic.md, "Environments from the ecosystem"): MCP tool servers (:mod:`.mcp`, ``env.name:
mcp``) and OpenEnv environments (:mod:`.openenv`, ``env.name: openenv``). Every one of them goes
through the rollout's token-in/token-out path: its observations are rendered by the chat template
and appended (:mod:`tidal.envs.chat`), never re-encoding what the engine sampled.
"""
