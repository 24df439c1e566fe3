"""Self-speculative decoding (paper section 6, "Zero-Shot Self-Speculative Decoding"): the model drafts with
few core iterations and verifies with the full number. A request with `draft_steps` in the continuous batch
(rdlm.inference.batching) runs one round per step in its own row, after its prompt is prefilled as any
other's: the scheduler plans the round (rdlm.inference.scheduling.plan.StepPlan.rounds) and the step calls
runs it here.

A draft needs no second model: the prelude's output and the first N iterations of a token do not depend
on how many iterations follow, and s_0 depends only on (seed, position), so the draft's states and
cache slots 0..N-1 are the first N iterations of the verification too.
"""

from __future__ import annotations

import torch

from rdlm.inference.execution.model_calls import ModelCalls
from rdlm.inference.runner.row_state import RowState
from rdlm.inference.runner.sampling import NonFiniteLogitsError, read_tokens


def speculate(calls: ModelCalls, request: RowState, start: int, token: int) -> tuple[list[int], int, int]:
    """One round for `request` from its pending token `token` (chosen, not yet fed at buffer index `start` of
    its row). Draft `draft_length` (L) tokens greedily with `draft_steps` (N) iterations each;
    then continue those L positions from iteration N to `num_steps` (M) in one forward. Accept drafts while
    they equal the verified greedy choice; the row's entries past the accepted ones are forgotten. The
    tokens are plain greedy decoding's exactly in float32; in bfloat16/float16 the batched verification
    rounds differently from one-token decoding, so a near-tie (top-2 logits a few units in the last place
    apart) may go the other way (see rdlm.inference.generate).
    Returns (new tokens: accepted drafts then the next pending token, drafted, accepted)."""
    c, row = request.config, request.row
    assert c.draft_steps is not None  # a speculative request: only those run rounds
    length = min(c.draft_length, calls.cache.max_length - start)
    fed, embedded, states = [token], [], []
    for k in range(length):
        calls.admit(start + k, 1, row)
        call = calls.block(start + k, 1, row=row)
        e = calls.embed(calls.upload([[fed[-1]]]), call)
        noise = None if request.noise is None else request.noise[start + k].view(1, 1, -1)
        state = calls.iterate(calls.start_state(e, noise), e, call, range(c.draft_steps))
        logits = calls.readout(state, call)
        embedded.append(e)
        states.append(state)
        fed.append(int(logits[0, -1].argmax()))
    drafts = fed[1:]
    # Verify: iterations N..M-1 for all L drafted positions at once.
    call = calls.block(start, length, row=row)
    state = calls.iterate(torch.cat(states, dim=1), torch.cat(embedded, dim=1), call, range(c.draft_steps, c.num_steps))
    logits = calls.readout(state, call)[0]
    verified, finite = read_tokens(logits.argmax(dim=-1), logits)
    if not finite:
        raise NonFiniteLogitsError(calls.model, start + 1 - len(request.prompt))
    accepted = 0
    while accepted < length and drafts[accepted] == verified[accepted]:
        accepted += 1
    processed = min(accepted + 1, length)  # positions whose cache entries are now final
    calls.rewind(start + processed, row)
    return drafts[: processed - 1] + [verified[processed - 1]], length, accepted
