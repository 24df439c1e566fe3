"""Self-speculative decoding (paper section 6, "Zero-Shot Self-Speculative Decoding"): the model drafts with
few core iterations and verifies with the full number, over one `Sequences` (rdlm.inference.engine) of one
prompt. `rdlm.inference.static.StaticBatch` runs a round per step after the prefill.

A draft needs no second model: the prelude's output and the first N iterations of a token do not depend
on how many iterations follow, and s_0 depends only on (seed, position), so the draft's states and
cache slots 0..N-1 are the first N iterations of the verification too.
"""

from __future__ import annotations

import torch

from rdlm.inference.engine import Sequences
from rdlm.inference.sampling import NonFiniteLogitsError, read_tokens


def speculate(seqs: Sequences, pending: int, draft_steps: int, num_steps: int,
              draft_length: int) -> tuple[list[int], int, int]:
    """One round from the `pending` token (chosen, not yet fed). Draft `draft_length` (L) tokens greedily
    with `draft_steps` (N) iterations each; then continue those L positions from iteration N to
    `num_steps` (M) in one forward. Accept drafts while they equal the verified greedy choice. The tokens
    are plain greedy decoding's exactly in float32; in bfloat16/float16 the batched verification rounds
    differently from one-token decoding, so a near-tie (top-2 logits a few units in the last place apart)
    may go the other way (see rdlm.inference.generate).
    Returns (new tokens: accepted drafts then the next pending token, drafted, accepted)."""
    runner, start = seqs.runner, seqs.length
    length = min(draft_length, seqs.cache.max_length - start)
    fed, embedded, states = [pending], [], []
    for _ in range(length):
        e, call = seqs.append(torch.tensor([[fed[-1]]], device=seqs.device))
        state = runner.iterate(runner.initial_state(e, call.positions), e, call, range(draft_steps))
        logits = runner.readout(state, call)
        embedded.append(e)
        states.append(state)
        fed.append(int(logits[0, -1].argmax()))
    drafts = fed[1:]
    # Verify: iterations N..M-1 for all L drafted positions at once.
    call, e = runner.block(start, length), torch.cat(embedded, dim=1)
    state = runner.iterate(torch.cat(states, dim=1), e, call, range(draft_steps, num_steps))
    logits = runner.readout(state, call)[0]
    verified, finite = read_tokens(logits.argmax(dim=-1), logits)
    if not finite:
        raise NonFiniteLogitsError(seqs.model, start + 1 - seqs.prompt_length)
    accepted = 0
    while accepted < length and drafts[accepted] == verified[accepted]:
        accepted += 1
    processed = min(accepted + 1, length)  # positions whose cache entries are now final
    seqs.rewind(start + processed)
    return drafts[:processed - 1] + [verified[processed - 1]], length, accepted
