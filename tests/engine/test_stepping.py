"""tidal.engine.stepping.run_steps, the one loop over an incremental engine: the order of its hooks,
when it stops, what it returns, and that it leaves the engine idle, on a counting engine where
request ``r`` finishes after ``length`` steps (its request id's tens digit, at least 1)."""

import pytest

from tidal.engine.base import Completion, Request, SamplingParams
from tidal.engine.stepping import GroupsComplete, run_steps

PARAMS = SamplingParams(max_new_tokens=50)


class CountingEngine:
    """Each step adds one token (7) to every live request; request ``i`` finishes (``stop``) once it
    has ``i // 10`` tokens (at least 1). ``log``: every call, in order."""

    def __init__(self):
        self.live, self.log = {}, []

    def add(self, requests):
        self.log.append(("add", [r.request_id for r in requests]))
        for r in requests:
            self.live[r.request_id] = (r, [])

    def has_unfinished(self):
        return bool(self.live)

    def _done(self, rid, reason):
        r, tokens = self.live.pop(rid)
        return Completion(prompt_ids=r.prompt_ids, token_ids=tokens, logprobs=[0.0] * len(tokens), finish_reason=reason,
                          request_id=rid, group_id=r.group_id, versions=[0] * len(tokens))

    def step(self):
        self.log.append(("step", None))
        for _, tokens in self.live.values():
            tokens.append(7)
        return [self._done(rid, "stop") for rid, (_, t) in list(self.live.items()) if len(t) >= max(rid // 10, 1)]

    def abort(self, request_ids=None):
        self.log.append(("abort", None))
        return [self._done(rid, "abort") for rid in list(self.live)]


def _req(rid, group=None):
    return Request(request_id=rid, prompt_ids=[1], params=PARAMS, group_id=group)


def test_runs_every_request_to_its_end_and_reports_each_in_its_step():
    eng, seen = CountingEngine(), []
    run = run_steps(eng, [_req(30), _req(10), _req(21)], on_finished=lambda c: seen.append((c.request_id, eng.log.count(("step", None)))))
    assert seen == [(10, 1), (21, 2), (30, 3)]  # the moment each finished, in step order
    assert [c.request_id for c in run.finished] == [10, 21, 30] and run.unfinished == [] and run.steps == 3
    assert eng.log[-1] == ("abort", None) and not eng.has_unfinished()


def test_groups_complete_is_asked_before_the_first_step_and_after_each():
    eng = CountingEngine()
    reqs = [_req(10, 0), _req(40, 0), _req(20, 1), _req(21, 1), _req(30, 2)]
    rule = GroupsComplete(reqs, 1)
    run = run_steps(eng, reqs, stop=rule)
    assert rule.completed == [1] and run.steps == 2  # group 1 completes at step 2; group 0 waits on request 40
    assert [c.request_id for c in run.finished] == [10, 20, 21]
    assert [(c.request_id, len(c.token_ids), c.finish_reason) for c in run.unfinished] == [(40, 2, "abort"), (30, 2, "abort")]
    # per owner: owner "a" needs 2 groups (0 and 2), owner "b" none; a count of 0 alone never steps
    rule = GroupsComplete(reqs, {"a": 2, "b": 0}, owner={0: "a", 1: "b", 2: "a"})
    assert run_steps(CountingEngine(), reqs, stop=rule).steps == 4 and rule.completed == [1, 2, 0]
    idle = CountingEngine()
    assert run_steps(idle, reqs, stop=GroupsComplete(reqs, 0)).steps == 0 and len(idle.log) == 2  # add, abort
    with pytest.raises(ValueError, match="no group_id"):
        GroupsComplete([_req(1)], 1)


def test_feed_adds_between_steps_and_keeps_an_idle_engine_going_until_it_returns_none():
    eng = CountingEngine()
    script = iter([[_req(10)], [], [], [_req(20)], None, None, None])  # [] while request 10 is gone: wait, no step
    run = run_steps(eng, feed=lambda: next(script))
    assert [c.request_id for c in run.finished] == [10, 20] and run.steps == 3
    assert [e for e, _ in eng.log] == ["add", "step", "add", "step", "step", "abort"]


def test_an_error_aborts_what_is_in_flight_and_a_busy_engine_is_refused():
    eng = CountingEngine()

    def boom(c):
        raise KeyError("reward failed")

    with pytest.raises(KeyError, match="reward failed"):
        run_steps(eng, [_req(10), _req(30)], on_finished=boom)
    assert not eng.has_unfinished() and eng.log[-1] == ("abort", None)
    eng.add([_req(10)])
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        run_steps(eng, [_req(20)])
    assert list(eng.live) == [10]  # nothing added, nothing aborted
