"""A verifiers v1 environment of our own making (taskset id ``vf_answer``, with tests/ecosystem on the path): each
task is a data row (its prompt and ``reference``), its reward 1 when the last reply holds the
reference; its harness is a two-turn chat program run in process (the model answers, is told
"Again.", answers again) that calls the model through verifiers' interception endpoint, as every
harness program does."""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

__all__ = ["AnswerTaskset", "TwoTurnHarness"]


class AnswerData(vf.TaskData):
    reference: str = ""


class AnswerTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def holds_reference(self, task, trace) -> float:
        reply = trace.last_reply or ""
        return 1.0 if task.reference and task.reference in reply else 0.0


class AnswerTaskset(vf.Taskset[AnswerTask, vf.TasksetConfig]):
    def load(self):  # the trainer's rows are the tasks (tidal.envs.adapters.verifiers); these serve `vf-eval`
        for a, b in ((1, 2), (3, 4)):
            yield AnswerTask(AnswerData(prompt=f"Calculate {a}+{b}", reference=str(a + b)), self.config.task)


class TwoTurnHarnessConfig(vf.HarnessConfig):
    turns: int = 2


class TwoTurnHarness(vf.Harness[TwoTurnHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=endpoint, api_key=secret)
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [m.model_dump(exclude_none=True) for m in prompt]
        try:
            for turn in range(self.config.turns):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
                if turn + 1 < self.config.turns:
                    messages.append({"role": "user", "content": "Again."})
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")
