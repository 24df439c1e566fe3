"""The continuous batch's scheduler alone: no model, no tensors. Each test takes its plans (`schedule`), feeds it
made-up outcomes as a step runner would give them back (`update`: tokens chosen, prompts ended, exit flags
found at a look; `coda_ran`: a coda's tokens) and checks its decisions, the whole step's plan included."""

import itertools
import random
from dataclasses import replace

from rdlm.inference.exits.criteria import make_exit_criterion
from rdlm.inference.params import GenerationConfig
from rdlm.inference.scheduling.plan import Chosen, Done, EngineSettings, RoundOutput, StepOutput
from rdlm.inference.scheduling.request import Request, Status
from rdlm.inference.scheduling.scheduler import CHUNK_COST, Scheduler, length_groups

FIXED = GenerationConfig(num_steps=8, max_new_tokens=3)
KL = GenerationConfig(num_steps=8, max_new_tokens=3, exit_criterion="kl", exit_threshold=1e-3)
LATENT = GenerationConfig(num_steps=16, max_new_tokens=3, exit_criterion="latent-diff", exit_threshold=0.03)


def request(i: int, config: GenerationConfig = FIXED, prompt: tuple = (1, 2, 3)) -> Request:
    criterion = None if config.exit_criterion is None else make_exit_criterion(config.exit_criterion,
                                                                                config.exit_threshold)
    return Request(i, list(prompt), config, criterion, config.core_slots)


def scheduler(max_batch: int = 2, **settings) -> Scheduler:
    return Scheduler(EngineSettings(max_batch, max_length=64, num_slots=16, **settings))


def prefilled(s: Scheduler, *requests: Request, token: int = 7) -> list:
    """Requests admitted, their prompts prefilled in the steps the plans give them, each first token chosen."""
    for q in requests:
        s.add(q)
    events = []
    while any(q.status in (Status.WAITING, Status.PREFILLING) for q in requests):
        plan = s.schedule()
        ended = [spec.chunk for spec in (c.spec for c in s.chunks)
                 if spec.chunk in plan.prompts and next(c for c in s.chunks if c.spec.chunk == spec.chunk).left
                 <= max(plan.prompt_iterations, 1)]
        first = [Chosen(q.id, token, q.cap) for c in s.chunks if c.spec.chunk in ended
                 for q, chooses in zip(c.requests, c.spec.chooses) if chooses]
        events += s.update(plan, StepOutput(ended=ended, prompt_iterations=max(plan.prompt_iterations, 1),
                                            first=first, computed=tuple(it.request for it in plan.iterating)))
    return events


def test_admission_fills_free_rows_in_order_and_plans_one_chunk_per_depth_and_budget():
    s = scheduler(max_batch=2, prefill_chunk=2)
    a, b, c = request(0), request(1, GenerationConfig(num_steps=4, max_new_tokens=3)), request(2)
    for q in (a, b, c):
        s.add(q)
    plan = s.schedule()
    assert [(x.request, x.row, x.positions) for x in plan.admitted] == [(0, 0, 6), (1, 1, 6)]
    assert [(x.requests, x.start, x.lengths, x.cap, x.n) for x in plan.chunks] == [((0,), 0, (2,), 8, 2),
                                                                                    ((1,), 0, (2,), 4, 2)]
    assert [(x.ends, x.chooses) for x in plan.chunks] == [((False,), (False,))] * 2   # 3-token prompts go on
    assert [q.status for q in (a, b, c)] == [Status.PREFILLING, Status.PREFILLING, Status.WAITING]
    assert (s.running, s.queued, s.busy) == (2, 1, True)
    # nothing decodes: the prompts run on until a chunk is done (the fewest left: b's 4)
    assert plan.prompts == (0, 1) and plan.prompt_iterations == 4 and not plan.iterating and not plan.look


def test_prompts_admitted_together_are_chunked_by_length_not_padded_to_the_longest():
    s = scheduler(max_batch=4, prefill_chunk=64)
    lengths = (5, 40, 4, 6)
    for i, n in enumerate(lengths):
        s.add(request(i, prompt=tuple(range(1, n + 1))))
    plan = s.schedule()
    # one chunk of 3 x 6 tokens and one of 40, not 4 x 40: 58 tokens and two chunks' cost instead of 160
    assert [(x.requests, x.lengths, x.n) for x in plan.chunks] == [((0, 2, 3), (5, 4, 6), 6), ((1,), (40,), 40)]
    assert all(x.ends == (True,) * len(x.requests) for x in plan.chunks)
    # without a decoding row, both run on until the first is done; the short prompts choose their tokens together
    assert plan.prompts == (0, 1) and plan.prompt_iterations == 8


def _partitions(items: list[int]):
    """Every set partition of `items`."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first, *part[k]]] + part[k + 1:]
        yield [[first], *part]


def test_length_groups_is_the_cheapest_split_of_all():
    def cost(lengths, groups, per_chunk):
        return sum(len(g) * max(lengths[j] for j in g) + per_chunk for g in groups)

    rng = random.Random(3)
    for _ in range(150):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 7))]
        per_chunk = rng.choice([0, 1, CHUNK_COST, 30, 1000])
        groups = length_groups(lengths, per_chunk)
        assert sorted(itertools.chain(*groups)) == list(range(len(lengths)))   # each prompt in one chunk
        assert groups == sorted(groups) and all(g == sorted(g) for g in groups)  # in admission order
        best = min(cost(lengths, p, per_chunk) for p in _partitions(list(range(len(lengths)))))
        assert cost(lengths, groups, per_chunk) == best
    assert length_groups([7, 7, 7], CHUNK_COST) == [[0, 1, 2]] and length_groups([], CHUNK_COST) == []
    assert length_groups([5, 4, 30, 5], 1000) == [[0, 1, 2, 3]]


def test_a_long_prompt_goes_on_in_its_next_chunk_and_its_first_token_starts_it():
    s = scheduler(max_batch=1, prefill_chunk=2)
    q = request(0, FIXED, prompt=(1, 2, 3))
    s.add(q)
    plan = s.schedule()
    assert plan.chunks[0].lengths == (2,) and plan.chunks[0].ends == (False,)
    assert s.update(plan, StepOutput(ended=[plan.chunks[0].chunk], prompt_iterations=8)) == []
    plan = s.schedule()                          # the rest of the prompt, one token, begins now
    assert [(x.start, x.lengths, x.ends, x.chooses) for x in plan.chunks] == [(2, (1,), (True,), (True,))]
    assert q.status is Status.PREFILLING
    events = s.update(plan, StepOutput(ended=[plan.chunks[0].chunk], prompt_iterations=8,
                                       first=[Chosen(0, 5, 8, (-0.5, ()))]))
    assert [(e.token, e.iterations, e.finish_reason, e.logprob) for e in events] == [(5, 8, None, -0.5)]
    assert (q.status, q.length, q.tokens, q.spent) == (Status.STARTING, 3, [5], 8)
    plan = s.schedule()
    assert [(x.token, x.position, x.cap) for x in plan.starts] == [(5, 3, 8)] and plan.lockstep
    assert q.status is Status.ITERATING and plan.iterations == 8


def test_cancelled_requests_leave_the_queue_their_rows_and_their_chunk():
    s = scheduler(max_batch=2)
    a, b, c = request(0), request(1), request(2)
    for q in (a, b, c):
        s.add(q)
    plan = s.schedule()
    assert plan.chunks[0].requests == (0, 1)
    s.update(plan, StepOutput(prompt_iterations=1))
    s.cancel(0)
    s.cancel(2)
    plan = s.schedule()
    assert plan.dropped == (0,) and [c.spec.requests for c in s.chunks] == [(1,)] and s.queued == 0
    assert s.chunks[0].iteration == 1 and s.chunks[0].spec.n == 3   # still padded as the runner's chunk is
    assert [(spec.requests, keep) for spec, keep in plan.narrowed] == [((1,), (1,))]   # the runner's goes on so
    s.update(plan, StepOutput(prompt_iterations=1))
    s.cancel(1)
    plan = s.schedule()
    assert [(spec.requests, keep) for spec, keep in plan.narrowed] == [((), ())] and not s.chunks   # it goes


def test_the_host_looks_every_sync_every_steps_and_a_look_resets_the_count():
    s = scheduler(max_batch=3, exit_sync_every=3)
    a, b, c = request(0, KL), request(1, replace(KL, num_steps=12)), request(2, replace(KL, num_steps=16))
    prefilled(s, a, b, c)
    looks = []
    for _ in range(6):
        plan = s.schedule()
        looks.append(plan.look)
        assert plan.look_at_cap == ()
        # the runner looks when the plan says so (or when a request of look_at_cap computed); none is done
        s.update(plan, StepOutput(computed=(0, 1, 2), found={} if plan.look else None))
    assert looks == [False, False, True, False, False, True] and (a.iteration, c.iteration) == (6, 6)
    plan = s.schedule()
    assert not plan.look and [(it.iteration, it.cap) for it in plan.iterating][0] == (6, 8)
    assert plan.look_at_cap == ()                     # a reaches its cap at the next step's iteration
    s.update(plan, StepOutput(computed=(0, 1, 2)))
    plan = s.schedule()
    assert not plan.look and plan.look_at_cap == (0,)   # a computing would reach its cap: the runner looks
    s.update(plan, StepOutput(computed=(0, 1, 2), found={}))
    assert s.since_look == 0 and not s.schedule().look


def test_what_the_look_finds_waits_for_its_coda_and_the_coda_gives_the_next_tokens():
    s = scheduler(max_batch=3, exit_sync_every=1, coda_every=4)
    a, b, c = request(0, KL), request(1, KL), request(2, FIXED)
    prefilled(s, a, b, c)
    plan = s.schedule()                  # different depth settings: one iteration a step, no lockstep
    assert not plan.lockstep and [it.request for it in plan.iterating] == [0, 1, 2] and plan.look
    s.update(plan, StepOutput(computed=(0, 1, 2), found={0: 1}))
    assert (a.status, a.iteration, a.stopped_at) == (Status.AWAITING_CODA, 1, s.clock)
    assert (b.status, b.iteration, c.iteration) == (Status.ITERATING, 1, 1)
    assert s.coda_due() is None          # alone of three it waits: b may exit any time
    plan = s.schedule()
    assert [it.request for it in plan.iterating] == [1, 2]
    s.update(plan, StepOutput(computed=(1, 2), found={1: 2}))
    assert s.coda_due() == (Done(0, 0, 3, 1), Done(1, 1, 3, 2))   # with b, two of three wait: in row order
    events = s.coda_ran([Chosen(0, 4, 1), Chosen(1, 5, 2)])
    assert [(e.request, e.token, e.iterations) for e in events] == [(0, 4, 1), (1, 5, 2)]
    assert (a.status, a.length, b.status, b.length) == (Status.STARTING, 4, Status.STARTING, 4)


def test_a_coda_runs_once_one_waited_or_half_wait_or_nobody_else_can_be_done_in_time():
    def found(s, requests, done, computed):
        plan = s.schedule()
        s.update(plan, StepOutput(computed=computed, found=done))
        return s.coda_due()

    s = scheduler(max_batch=4, exit_sync_every=1, coda_every=3)
    qs = [request(0, KL), request(1, KL), request(2, FIXED), request(3, FIXED)]
    prefilled(s, *qs)
    assert found(s, qs, {0: 1}, (0, 1, 2, 3)) is None          # 1 of 4 waits, and 1 may still exit
    assert found(s, qs, {}, (1, 2, 3)) is None                 # waited one step of the two it may
    assert [d.request for d in found(s, qs, {}, (1, 2, 3))] == [0]   # waited long enough: its coda alone
    t = scheduler(max_batch=3, exit_sync_every=1, coda_every=4)
    rs = [request(0, KL), request(1, FIXED), request(2, FIXED)]
    prefilled(t, *rs)
    assert [d.request for d in found(t, rs, {0: 1}, (0, 1, 2))] == [0]   # the others end at their caps, 7 steps
    # away, after its wait of 3: nobody else can be done before then
    u = scheduler(max_batch=3, exit_sync_every=1, coda_every=8)
    prefilled(u, *[request(0, KL), request(1, FIXED), request(2, FIXED)])
    assert found(u, rs, {0: 1}, (0, 1, 2)) is None             # ... but within a wait of 7 they can


def test_lockstep_needs_every_row_starting_together_with_one_depth_setting():
    s = scheduler(max_batch=3)
    a, b = request(0), request(1)
    prefilled(s, a, b)
    assert s.in_lockstep([a, b], prompts_in_flight=False)
    assert not s.in_lockstep([a, b], prompts_in_flight=True)
    assert not s.in_lockstep([a], prompts_in_flight=False)             # b is not starting with it
    s.add(request(2))
    assert not s.in_lockstep([a, b], prompts_in_flight=False)          # one waits for the free row
    t = scheduler(max_batch=2)
    c, d = request(0), request(1, GenerationConfig(num_steps=6, max_new_tokens=3))
    prefilled(t, c, d)
    t.start([c, d])
    assert not t.in_lockstep([c, d], prompts_in_flight=False)
    budget = GenerationConfig(num_steps=8, max_new_tokens=3, max_latent_iterations=10)
    u = scheduler(max_batch=1)
    (e,) = [request(0, budget)]
    prefilled(u, e)
    u.start([e])
    assert not u.in_lockstep([e], prompts_in_flight=False)


def test_rows_done_on_the_device_leave_the_call_only_where_reading_the_flags_is_free():
    for rides_along, peeks in ((False, True), (True, False)):
        s = scheduler(max_batch=3, exit_sync_every=4, rides_along=rides_along)
        a, b, c = request(0, KL), request(1, KL), request(2, FIXED)
        prefilled(s, a, b, c)
        first = s.schedule()
        assert not first.peek and not first.since_look                 # right after a look nobody is done
        s.update(first, StepOutput(computed=(0, 1, 2)))
        later = s.schedule()
        assert later.peek == peeks and later.since_look
        s.update(later, StepOutput(computed=(1, 2)))                    # a left the call: it ran no more
        assert (a.iteration, b.iteration, c.iteration) == (1, 2, 2)
    f = scheduler(max_batch=2, exit_sync_every=4)
    x, y = request(0, FIXED), request(1, GenerationConfig(num_steps=6, max_new_tokens=3))
    prefilled(f, x, y)
    plan = f.schedule()
    f.update(plan, StepOutput(computed=tuple(it.request for it in plan.iterating)))
    assert not f.schedule().peek                                       # no criterion: nothing to read


def test_iterations_fuse_only_when_nothing_can_change_but_the_counts():
    s = scheduler(max_batch=2, static=True)
    a, b = request(0), request(1)
    prefilled(s, a, b)
    s.start([a, b])
    a.iteration, b.iteration = 1, 0
    assert s.fusable([a, b], prompts_in_flight=False) == 4          # 7 left: the largest power of 2
    assert s.fusable([a, b], prompts_in_flight=True) == 1
    assert s.fusable([a], prompts_in_flight=False) == 1            # b waits for its coda
    eager = scheduler(max_batch=2)
    c, d = request(0), request(1)
    prefilled(eager, c, d)
    assert eager.fusable(eager.start([c, d]), prompts_in_flight=False) == 1
    k = scheduler(max_batch=1, static=True)
    (e,) = [request(0, KL)]
    prefilled(k, e)
    assert k.fusable(k.start([e]), prompts_in_flight=False) == 1           # an exit may come any time


def test_rows_whose_criterion_reads_the_states_alone_fuse_up_to_the_next_look():
    """A state-only criterion (latent-diff, cosine) is read inside the static step, so its rows fuse iterations
    too, up to the host's next look (`exit_sync_every` iterations after the last), which the fused step ends
    with; a criterion that reads logits still runs one iteration a step."""
    s = scheduler(max_batch=2, static=True, exit_sync_every=4, coda_every=8)
    a, b = request(0, LATENT), request(1)
    prefilled(s, a, b)
    plan = s.schedule()
    assert not plan.lockstep and plan.iterations == 4 and plan.look          # b's 8 left, the look after 4
    s.update(plan, StepOutput(computed=(0, 1), found={}))
    assert (a.iteration, b.iteration, s.since_look) == (4, 4, 0)
    plan = s.schedule()
    assert plan.iterations == 4 and plan.look and plan.look_at_cap == (1,)    # b reaches its cap too
    s.update(plan, StepOutput(computed=(0, 1), found={0: 6, 1: 8}))         # a exited after 6 iterations
    assert (a.status, a.iteration, a.stopped_at) == (Status.AWAITING_CODA, 6, s.clock)
    k = scheduler(max_batch=2, static=True, exit_sync_every=4)
    c, d = request(0, LATENT), request(1, KL)
    prefilled(k, c, d)
    assert k.schedule().iterations == 1                                       # d's KL needs the host each iteration
    e = scheduler(max_batch=2, static=True, exit_sync_every=4, lockstep=False)   # (as the CPU's compiled step)
    f, g = request(0, LATENT), request(1, LATENT)
    prefilled(e, f, g)
    e.since_look = 3                                                          # one iteration to the next look
    assert e.schedule().iterations == 1 and e.fusable([f, g], prompts_in_flight=False) == 1


def test_a_fused_step_never_keeps_a_row_found_done_from_its_coda_longer_than_coda_every():
    s = scheduler(max_batch=3, static=True, exit_sync_every=8, coda_every=4, lockstep=False)
    a, b, c = request(0, LATENT), request(1, LATENT), request(2, LATENT)
    prefilled(s, a, b, c)
    plan = s.schedule()
    assert plan.iterations == 8 and plan.look
    s.update(plan, StepOutput(computed=(0, 1, 2), found={0: 5}))
    assert s.coda_due() is None                                  # one of three waits: the others may exit any time
    plan = s.schedule()
    assert [it.request for it in plan.iterating] == [1, 2] and plan.iterations == 2   # a may wait 3 more: 2 fused
    s.update(plan, StepOutput(computed=(1, 2)))
    assert (b.iteration, s.since_look) == (10, 2) and s.coda_due() is None
    plan = s.schedule()
    assert plan.iterations == 1                                  # one iteration of a's wait left
    s.update(plan, StepOutput(computed=(1, 2)))
    assert [d.request for d in s.coda_due()] == [0]              # it waited coda_every - 1 iterations


def test_a_static_plan_fuses_iterations_and_the_host_looks_when_the_cap_comes():
    s = scheduler(max_batch=2, static=True, exit_sync_every=8)
    a, b = request(0), request(1, GenerationConfig(num_steps=6, max_new_tokens=3))
    prefilled(s, a, b)
    plan = s.schedule()
    assert not plan.lockstep and plan.iterations == 4 and not plan.look   # b's 6 left: 4 at once
    s.update(plan, StepOutput(computed=(0, 1)))
    assert (a.iteration, b.iteration) == (4, 4)
    plan = s.schedule()
    assert plan.iterations == 2 and plan.look_at_cap == (1,)   # b's 2 left; the runner looks at its cap
    s.update(plan, StepOutput(computed=(0, 1), found={1: 6}))
    assert (a.status, b.status, b.iteration) == (Status.ITERATING, Status.AWAITING_CODA, 6)


def test_a_token_starts_in_phase_with_the_rows_iterating_so_they_keep_fusing():
    s = scheduler(max_batch=2, static=True, exit_sync_every=8)
    a, b = request(0), request(1)
    prefilled(s, a, b)
    s.start([a])
    a.iteration = 3                                      # a is 3 iterations into its token when b's comes
    plan = s.schedule()
    assert plan.starts == () and s.holding == 1 and b.status is Status.STARTING   # b waits for a's token to end
    assert plan.iterations == 4                          # and a fuses its 5 left as if it were alone: 4, then 1
    s.update(plan, StepOutput(computed=(0,)))
    plan = s.schedule()
    assert plan.starts == () and plan.iterations == 1 and plan.look_at_cap == (0,)
    s.update(plan, StepOutput(computed=(0,), found={0: 8}))
    plan = s.schedule()                                  # nobody iterates: b starts, a's coda comes when due
    assert [x.request for x in plan.starts] == [1] and s.holding == 0 and b.status is Status.ITERATING


def test_a_token_starts_at_once_where_phases_cannot_fuse():
    for static, config_a, config_b in [(False, FIXED, FIXED), (True, KL, FIXED), (True, FIXED, KL)]:
        s = scheduler(max_batch=2, static=static)
        a, b = request(0, config_a), request(1, config_b)
        prefilled(s, a, b)
        s.start([a])
        a.iteration = 3
        plan = s.schedule()
        assert [x.request for x in plan.starts] == [1] and s.holding == 0, (static, config_a, config_b)
    s = scheduler(max_batch=3, static=True)              # rows at two phases: nothing to keep together
    a, b, c = request(0), request(1), request(2)
    prefilled(s, a, b, c)
    s.start([a, b])
    a.iteration, b.iteration = 3, 5
    assert [x.request for x in s.schedule().starts] == [2]


def test_a_depth_budget_caps_each_token_and_ends_the_response():
    budget = GenerationConfig(num_steps=8, max_new_tokens=4, max_latent_iterations=10)
    s = scheduler(max_batch=1)
    q = request(0, budget)
    s.add(q)
    plan = s.schedule()
    assert q.cap == 7 and plan.chunks[0].cap == 7     # 10, less one for each of the three later tokens
    s.update(plan, StepOutput(ended=[plan.chunks[0].chunk], prompt_iterations=7, first=[Chosen(0, 1, 7)]))
    plan = s.schedule()
    assert q.cap == 1 and plan.starts[0].cap == 1      # 3 left for 3 tokens
    assert not plan.lockstep                           # a depth budget: a token at a time
    s.update(plan, StepOutput(computed=(0,), found={0: 1}))
    assert s.coda_due() == (Done(0, 0, 3, 1),)
    events = s.coda_ran([Chosen(0, 2, 1)])
    assert [(e.finish_reason, e.cap) for e in events] == [(None, 1)] and q.spent == 8


def test_the_prompts_share_of_a_step():
    s = scheduler(max_batch=2, prefill_chunk=64)
    assert s.extra_prompt_iterations(64, iterations_left=5, decoding=True) == 0
    assert s.extra_prompt_iterations(16, iterations_left=5, decoding=True) == 3
    assert s.extra_prompt_iterations(16, iterations_left=5, decoding=False) == 5   # nobody waits for them


def test_requests_that_decode_in_rounds_are_planned_apart_and_a_prefill_alone_ends_after_its_prompt():
    s = scheduler(max_batch=4)
    speculative = request(0, GenerationConfig(num_steps=8, max_new_tokens=3, draft_steps=2))
    wave = request(1, GenerationConfig(num_steps=8, max_new_tokens=3, sampler="parallel", full_prefill=False))
    alone = request(2, GenerationConfig(num_steps=8, max_new_tokens=0))
    empty_wave = request(3, GenerationConfig(num_steps=8, max_new_tokens=0, sampler="parallel", full_prefill=False))
    for q in (speculative, wave, alone, empty_wave):
        s.add(q)
    plan = s.schedule()
    assert [c.requests for c in plan.chunks] == [(0, 2)]          # the wave's first wave is its prompt
    assert [a.positions for a in plan.admitted] == [64, 64, 3]   # in rounds: s_0 for the whole context
    assert wave.status is Status.STARTING and s.rows[3] is None   # nothing at all to do for the empty wave
    assert plan.chunks[0].chooses == (True, False)               # a prefill alone chooses no token
    s.update(plan, StepOutput(ended=[plan.chunks[0].chunk], prompt_iterations=8, first=[Chosen(0, 5, 8)]))
    assert s.rows[2] is None and speculative.status is Status.STARTING
    plan = s.schedule()
    assert [(r.request, r.token, r.position) for r in plan.rounds] == [(0, 5, 3), (1, -1, 0)]
    assert not plan.lockstep and plan.iterating == () and plan.dropped == (2,)   # the prefill alone left
    events = s.update(plan, StepOutput(rounds=[RoundOutput(0, [(6, 8), (9, 8)], drafted=2, accepted=1),
                                               RoundOutput(1, [(4, 2)], exhausted=True)]))
    assert [(e.request, e.token, e.finish_reason) for e in events] == [(0, 6, None), (0, 9, "length"),
                                                                       (1, 4, "length")]
    assert (s.drafted, s.accepted, speculative.length, s.busy) == (2, 1, 5, False)


def test_a_failure_frees_its_row_and_the_next_plan_wipes_it():
    s = scheduler(max_batch=2)
    a, b = request(0), request(1)
    prefilled(s, a, b)
    broken = replace(a.config)
    object.__setattr__(broken, "min_steps", 2**63)   # past the declared bounds
    a.config = broken
    plan = s.schedule()
    assert [x.request for x in plan.starts] == [1] and plan.wipe == (0,) and plan.dropped == (0,)
    assert [(rid, type(err).__name__) for rid, err in s.failures] == [(0, "OverflowError")]
    assert "min_steps = 9223372036854775808" in str(s.failures[0][1])
    events = s.update(plan, StepOutput(lockstep=[Chosen(1, error=FloatingPointError("nan"))]))
    assert events == [] and not s.busy and [rid for rid, _ in s.failures] == [0, 1]
    assert s.schedule().wipe == (1,)
