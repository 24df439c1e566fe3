"""The continuous batch's scheduler alone: no model, no tensors. Each test feeds it made-up outcomes (tokens
chosen, exit flags read at a look) and checks its decisions, as a runner would see them."""

from rdlm.inference.exits import make_exit_criterion
from rdlm.inference.params import GenerationConfig
from rdlm.inference.request import Request, Status
from rdlm.inference.scheduler import Prompts, Scheduler, StepPlan

FIXED = GenerationConfig(num_steps=8, max_new_tokens=3)
KL = GenerationConfig(num_steps=8, max_new_tokens=3, exit_criterion="kl", exit_threshold=1e-3)


def request(i: int, config: GenerationConfig = FIXED, prompt: tuple = (1, 2, 3)) -> Request:
    criterion = None if config.exit_criterion is None else make_exit_criterion(config.exit_criterion,
                                                                                config.exit_threshold)
    return Request(i, list(prompt), config, criterion, config.core_slots, generator=None, noise=None)


def admitted_and_started(s: Scheduler, *requests: Request) -> list[Request]:
    """Requests through admission and prefill to their first token, then started (ITERATING)."""
    for q in requests:
        s.add(q)
    s.admit()
    for q in requests:
        s.prefilled(q)
        s.chosen(q, token=7, steps=q.cap, decode=None)
    s.start(list(requests))
    return list(requests)


def test_admission_fills_free_rows_in_order_and_groups_by_depth_and_budget():
    s = Scheduler(max_batch=2)
    a, b, c = request(0), request(1, GenerationConfig(num_steps=4, max_new_tokens=3)), request(2)
    for q in (a, b, c):
        s.add(q)
    groups = s.admit()
    assert groups == {(8, 8): [a], (4, 4): [b]} and (a.row, b.row) == (0, 1)
    assert [q.status for q in (a, b, c)] == [Status.PREFILLING, Status.PREFILLING, Status.WAITING]
    assert (s.running, s.queued, s.busy) == (2, 1, True)
    s.prefilled(a)
    assert a.length == 3 and s.chosen(a, token=5, steps=8, decode=None) is None and a.status is Status.STARTING
    a.config = GenerationConfig(num_steps=8, max_new_tokens=1)          # its last token comes next
    s.start([a])
    assert s.chosen(a, token=6, steps=8, decode=None) == "length" and a.tokens == [5, 6] and a.spent == 16
    assert s.admit() == {(8, 8): [c]} and c.row == 0                 # the freed row goes to the next in line


def test_cancelled_requests_leave_the_queue_and_their_rows():
    s = Scheduler(max_batch=1)
    a, b = request(0), request(1)
    s.add(a)
    s.add(b)
    s.admit()
    s.cancel(0)
    s.cancel(1)
    assert s.drop_cancelled() == {0, 1} and not s.busy and s.drop_cancelled() == set()


def test_the_host_looks_every_sync_every_steps_or_at_once_when_a_row_reaches_its_cap():
    s = Scheduler(max_batch=2, exit_sync_every=3)
    a, b = admitted_and_started(s, request(0, KL), request(1, KL))
    looks = []
    for _ in range(5):
        s.ran([a, b])
        looks.append(s.step_ran([a, b]))
    assert looks == [False, False, True, False, False]
    a.iteration = a.cap                                      # surely done: no need to wait for the next look
    assert s.step_ran([a, b]) is True and s.since_look == 0
    s.looked([a, b], finished=[True, False], steps=[8, 6])
    assert (a.status, a.iteration, a.ready_since) == (Status.READY, 8, s.steps_run) and b.status is Status.ITERATING


def test_a_coda_waits_for_company_within_coda_every():
    s = Scheduler(max_batch=3, exit_sync_every=1, coda_every=4)
    a, b, c = admitted_and_started(s, request(0, KL), request(1, KL), request(2, KL))
    s.step_ran([a, b, c])
    s.looked([a, b, c], [True, False, False], [3, 1, 1])
    assert not s.coda_due([a])                  # b and c may exit any time: a waits for them
    for _ in range(3):
        s.step_ran([b, c])
    assert s.coda_due([a])                       # it waited coda_every - 1 steps
    s.looked([b], [True], [4])
    assert s.coda_due([a, b])                    # half the rows wait: now
    fixed = Scheduler(max_batch=3, exit_sync_every=1, coda_every=4)
    x, y, z = admitted_and_started(fixed, request(0), request(1), request(2))
    fixed.looked([x], [True], [8])
    y.iteration = z.iteration = 2                # without an exit neither can be done before the wait ends
    assert fixed.coda_due([x])


def test_lockstep_needs_every_row_starting_together_with_one_depth_setting():
    s = Scheduler(max_batch=3)
    a, b = admitted_and_started(s, request(0), request(1))
    assert s.in_lockstep([a, b], prompts_in_flight=False)
    assert not s.in_lockstep([a, b], prompts_in_flight=True)
    assert not s.in_lockstep([a], prompts_in_flight=False)             # b is not starting with it
    s.add(request(2))
    assert not s.in_lockstep([a, b], prompts_in_flight=False)          # one waits for the free row
    t = Scheduler(max_batch=2)
    c, d = admitted_and_started(t, request(0), request(1, GenerationConfig(num_steps=6, max_new_tokens=3)))
    assert not t.in_lockstep([c, d], prompts_in_flight=False)
    budget = GenerationConfig(num_steps=8, max_new_tokens=3, max_latent_iterations=10)
    u = Scheduler(max_batch=1)
    (e,) = admitted_and_started(u, request(0, budget))
    assert not u.in_lockstep([e], prompts_in_flight=False)


def test_rows_found_done_leave_the_call_only_where_reading_the_flags_is_free():
    s = Scheduler(max_batch=2, exit_sync_every=4)
    a, b = admitted_and_started(s, request(0, KL), request(1, KL))
    read = []
    flags = lambda: read.append(1) or [True, False]  # noqa: E731
    assert s.computing([a, b], rides_along=False, done=flags) == [a, b] and not read   # right after a look
    s.step_ran([a, b])
    assert s.computing([a, b], rides_along=True, done=flags) == [a, b] and not read
    assert s.computing([a, b], rides_along=False, done=flags) == [b] and read == [1]
    assert s.may_be_done([a, b])
    f = Scheduler(max_batch=1, exit_sync_every=4)
    (x,) = admitted_and_started(f, request(0))
    f.step_ran([x])
    assert f.computing([x], rides_along=False, done=flags) == [x] and read == [1]     # no criterion: no read
    assert not f.may_be_done([x])


def test_iterations_fuse_only_when_nothing_can_change_but_the_counts():
    s = Scheduler(max_batch=2)
    a, b = admitted_and_started(s, request(0), request(1))
    a.iteration, b.iteration = 1, 0
    assert s.fusable([a, b], static=True, prompts_in_flight=False) == 4          # 7 left: the largest power of 2
    assert s.fusable([a, b], static=False, prompts_in_flight=False) == 1
    assert s.fusable([a, b], static=True, prompts_in_flight=True) == 1
    assert s.fusable([a], static=True, prompts_in_flight=False) == 1            # b waits for its coda
    k = Scheduler(max_batch=1)
    (c,) = admitted_and_started(k, request(0, KL))
    assert k.fusable([c], static=True, prompts_in_flight=False) == 1           # an exit may come any time


def test_a_depth_budget_caps_each_token_and_ends_the_response():
    budget = GenerationConfig(num_steps=8, max_new_tokens=4, max_latent_iterations=10)
    s = Scheduler(max_batch=1)
    q = request(0, budget)
    s.add(q)
    s.admit()
    assert q.cap == 7                             # 10, less one for each of the three later tokens
    s.prefilled(q)
    s.chosen(q, token=1, steps=7, decode=None)
    s.start([q])
    assert q.cap == 1                             # 3 left for 3 tokens
    assert s.chosen(q, token=2, steps=1, decode=None) is None


def test_the_prompts_share_of_a_step():
    s = Scheduler(max_batch=2, prefill_chunk=64)
    assert s.extra_prompt_iterations(64, iterations_left=5, decoding=True) == 0
    assert s.extra_prompt_iterations(16, iterations_left=5, decoding=True) == 3
    assert s.extra_prompt_iterations(16, iterations_left=5, decoding=False) == 5   # nobody waits for them


def test_a_step_plan_runs_a_lockstep_token_or_the_next_iterations_and_counts_them_run():
    """`plan`: what the runner carries out, from the scheduler's decisions alone (no flags read unless asked)."""
    never = lambda: [False, False]  # noqa: E731
    s = Scheduler(max_batch=2)
    a, b = admitted_and_started(s, request(0), request(1))
    together = s.plan([a, b], None, static=False, rides_along=False, done=never)
    assert together == StepPlan((a, b), (a, b), 8, lockstep=True) and a.iteration == 0   # its coda counts them
    t = Scheduler(max_batch=2, prefill_chunk=64)
    c, d = admitted_and_started(t, request(0), request(1))
    d.iteration = 3                       # d started earlier: c's start does not make a lockstep token
    plan = t.plan([c], Prompts(tokens=16, fewest_left=6), static=False, rides_along=False, done=never)
    assert plan == StepPlan((c, d), (c, d), 1, False, (0, 3), False, prompt_iterations=4)  # 1 + 64 // 16 - 1
    assert (c.iteration, d.iteration) == (1, 4)
    t.step_ran([c, d])
    alone = t.plan([], None, static=True, rides_along=True, done=never)
    assert alone.iterations == 4 and alone.slots == (1, 4) and not alone.may_be_frozen   # 4 left for d: fused
    assert (c.iteration, d.iteration) == (5, 8) and alone.prompt_iterations == 0


def test_a_plan_may_freeze_rows_only_once_one_can_be_done_on_the_device():
    s = Scheduler(max_batch=2, exit_sync_every=4)
    a, b = admitted_and_started(s, request(0, KL), request(1, KL))
    first = s.plan([], None, static=False, rides_along=True, done=lambda: [False, False])
    assert first.computing == (a, b) and not first.may_be_frozen      # right after a look nobody is done
    s.step_ran([a, b])
    later = s.plan([], None, static=False, rides_along=False, done=lambda: [True, False])
    assert later.iterating == (a, b) and later.computing == (b,) and later.may_be_frozen
    assert (a.iteration, b.iteration) == (1, 2)                        # a left the call: it ran no more


def test_requests_that_decode_in_rounds_are_planned_apart_and_a_prefill_alone_ends_after_its_prompt():
    s = Scheduler(max_batch=4)
    speculative = request(0, GenerationConfig(num_steps=8, max_new_tokens=3, draft_steps=2))
    wave = request(1, GenerationConfig(num_steps=8, max_new_tokens=3, sampler="parallel", full_prefill=False))
    alone = request(2, GenerationConfig(num_steps=8, max_new_tokens=0))
    empty_wave = request(3, GenerationConfig(num_steps=8, max_new_tokens=0, sampler="parallel", full_prefill=False))
    for q in (speculative, wave, alone, empty_wave):
        s.add(q)
    groups = s.admit()
    assert groups == {(8, 8): [speculative, alone]}            # the wave's first wave is its prompt: no prefill
    assert wave.status is Status.STARTING and s.rows[3] is None  # nothing at all to do for the empty wave
    assert s.prefilled(speculative) and not s.prefilled(alone) and s.rows[2] is None
    s.chosen(speculative, token=5, steps=8, decode=None)
    starting, rounds = s.starting()
    assert starting == [] and rounds == [speculative, wave]
    plan = s.plan(starting, None, static=False, rides_along=False, done=lambda: [], rounds=rounds)
    assert plan.rounds == (speculative, wave) and not plan.lockstep and plan.computing == ()
