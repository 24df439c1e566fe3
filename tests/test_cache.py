import pytest
import torch

from rdlm import RDLMConfig
from rdlm.inference.execution.cache import RecurrentKVCache

CONFIG = RDLMConfig.from_preset("tiny")


def kv(batch=2, n=1, value=1.0):
    shape = (batch, CONFIG.num_heads, n, CONFIG.head_dim)
    return torch.full(shape, value), torch.full(shape, -value)


def test_update_writes_by_index_and_returns_everything_written_so_far():
    cache = RecurrentKVCache(CONFIG, batch_size=2, max_length=10, num_slots=4)
    k, v = kv(n=3, value=1.0)
    k_all, v_all = cache.at(0).update(("prelude", 0, -1), k, v)
    assert k_all.shape[2] == 3 and torch.equal(k_all, k) and torch.equal(v_all, v)
    k_all, _ = cache.at(3).update(("prelude", 0, -1), *kv(n=1, value=2.0))
    assert k_all.shape[2] == 4 and k_all[:, :, 3].eq(2).all() and k_all[:, :, :3].eq(1).all()
    # the returned tensors are views of the preallocated buffer, not copies
    assert k_all.data_ptr() == cache.prelude_k[0].data_ptr()


def test_full_cache_uses_a_slot_per_iteration_and_refuses_too_many():
    cache = RecurrentKVCache(CONFIG, 1, 4, num_slots=3)
    for i in range(3):
        cache.at(0).update(("core", 1, i), *kv(batch=1, value=float(i + 1)))
    assert [cache.core_k[1, s, 0, 0, 0, 0].item() for s in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="iteration 3 needs a cache slot.*shared"):
        cache.at(0).update(("core", 1, 3), *kv(batch=1))


def test_shared_cache_uses_slot_i_mod_k():
    cache = RecurrentKVCache(CONFIG, 1, 4, num_slots=2, strategy="shared")
    for i in range(5):
        cache.at(0).update(("core", 0, i), *kv(batch=1, value=float(i)))
    # slot 0 last written by iteration 4, slot 1 by iteration 3
    assert cache.core_k[0, 0, 0, 0, 0, 0].item() == 4 and cache.core_k[0, 1, 0, 0, 0, 0].item() == 3


def test_shared_cache_holds_k_over_r_of_the_full_core_cache():
    full = RecurrentKVCache(CONFIG, 2, 16, num_slots=32)
    shared = RecurrentKVCache(CONFIG, 2, 16, num_slots=4, strategy="shared")
    assert shared.core_nbytes * 32 == full.core_nbytes * 4
    assert shared.nbytes < full.nbytes
    layer_bytes = 2 * 2 * CONFIG.num_heads * 16 * CONFIG.head_dim * 4  # k and v, fp32
    assert full.nbytes == layer_bytes * (CONFIG.prelude_layers + 32 * CONFIG.core_layers + CONFIG.coda_layers)


def test_rows_that_do_not_write_keep_their_entries():
    cache = RecurrentKVCache(CONFIG, 2, 4, num_slots=2)
    cache.at(0).update(("core", 0, 0), *kv(value=1.0))
    k_all, _ = cache.at(0, core_writers=torch.tensor([True, False])).update(("core", 0, 0), *kv(value=5.0))
    assert k_all[0].eq(5).all() and k_all[1].eq(1).all()


def test_prelude_and_coda_rows_that_do_not_write_keep_their_entries_at_their_own_index():
    """A static call over every row (one token per row at its own device index, the continuous batch's compiled
    prelude and coda) where only some rows' tokens start or end: the others' entries stay as they were."""
    cache = RecurrentKVCache(CONFIG, 3, 4, num_slots=2)
    for group in ("prelude", "coda"):
        cache.at(0, rows=slice(None)).update((group, 0, -1), *kv(batch=3, n=4, value=1.0))
        index = torch.tensor([2, 0, 3])
        plan = cache.at(index, rows=torch.arange(3), writers=torch.tensor([False, True, False]), end=4)
        k_all, v_all = plan.update((group, 0, -1), *kv(batch=3, value=7.0))
        stored = cache.prelude_k[0] if group == "prelude" else cache.coda_k[0]
        assert stored[1, :, 0].eq(7).all() and stored[1, :, 1:].eq(1).all()  # the writer's token, at its index
        assert stored[0].eq(1).all() and stored[2].eq(1).all()  # the others' entries, at theirs too
        assert torch.equal(k_all, stored) and torch.equal(v_all, -stored)
        # the core's writers are its own: a core call's `writers` does not mask the core
        cache.at(index, rows=torch.arange(3), writers=torch.tensor([False] * 3)).update(("core", 0, 0), *kv(3, 1, 3.0))
        assert cache.core_k[0, 0, torch.arange(3), :, index].eq(3).all()


def test_fill_missing_gives_empty_slots_the_latest_entry():
    cache = RecurrentKVCache(CONFIG, 2, 4, num_slots=4)
    for i in range(4):
        cache.at(0).update(("core", 0, i), *kv(value=float(i + 1)))
    cache.fill_missing(torch.tensor([2, 4]), 0, 1)      # row 0 exited after 2 iterations
    row0 = [cache.core_k[0, s, 0, 0, 0, 0].item() for s in range(4)]
    row1 = [cache.core_k[0, s, 1, 0, 0, 0].item() for s in range(4)]
    assert row0 == [1, 2, 2, 2] and row1 == [1, 2, 3, 4]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="strategy"):
        RecurrentKVCache(CONFIG, 1, 4, 2, strategy="paged")
    with pytest.raises(ValueError, match="max_length"):
        RecurrentKVCache(CONFIG, 1, CONFIG.context_length + 1, 2)
    cache = RecurrentKVCache(CONFIG, 1, 2, 2)
    with pytest.raises(ValueError, match="holds 2 tokens"):
        cache.at(0).update(("prelude", 0, -1), *kv(batch=1, n=3))


def test_a_call_plan_is_an_argument_not_state_left_on_the_cache():
    # two calls planned at once write where each says, and a plan changed with `but` leaves the first alone
    cache = RecurrentKVCache(CONFIG, 2, 6, num_slots=2)
    first, second = cache.at(1), cache.at(4, rows=torch.tensor([0]))
    second.update(("prelude", 0, -1), *kv(batch=1, value=4.0))
    first.update(("prelude", 0, -1), *kv(value=1.0))
    assert cache.prelude_k[0, :, :, 1].eq(1).all() and cache.prelude_k[0, 0, :, 4].eq(4).all()
    assert cache.prelude_k[0, 1, :, 4].eq(0).all()
    budgeted = first.but(budget=1)
    budgeted.update(("core", 0, 1), *kv(value=3.0))            # iteration 1 in a budget of 1 slot: slot 0
    assert cache.core_k[0, 0, :, :, 1].eq(3).all() and cache.core_k[0, 1].eq(0).all()
    assert first.plan.budget is None and budgeted.plan.start == 1


def test_a_call_of_rows_reads_up_to_its_end_and_from_index_0_reads_its_own_new_keys():
    """Rows named by an index tensor: from index 0 the call reads the keys it wrote (no gather; the same values the
    cache holds), padded with zeros up to `end`; from a later index the cache's entries up to `end`, those
    past its tokens included (a mask hides them); `end` before the new tokens' end is refused by name."""
    cache = RecurrentKVCache(CONFIG, 3, 16, num_slots=2)
    cache.core_k.normal_()  # stale entries past every call's tokens
    rows = torch.tensor([2, 0])
    k, v = torch.randn(2, CONFIG.num_heads, 3, CONFIG.head_dim), torch.randn(2, CONFIG.num_heads, 3, CONFIG.head_dim)
    ks, vs = cache.at(0, rows=rows).update(("core", 1, 0), k, v)
    assert torch.equal(ks, k) and torch.equal(vs, v) and torch.equal(cache.core_k[1, 0][rows][:, :, :3], k)
    ks, vs = cache.at(0, rows=rows, end=8).update(("core", 1, 1), k, v)
    assert ks.shape[2] == vs.shape[2] == 8 and torch.equal(ks[:, :, :3], k) and ks[:, :, 3:].eq(0).all()
    later = torch.randn(2, CONFIG.num_heads, 2, CONFIG.head_dim)
    ks, _ = cache.at(3, rows=rows, end=8).update(("core", 1, 1), later, later)
    assert torch.equal(ks, cache.core_k[1, 1][rows][:, :, :8]) and torch.equal(ks[:, :, 3:5], later)
    with pytest.raises(ValueError, match="cannot read up to 4"):
        cache.at(3, rows=rows, end=4).update(("core", 1, 1), later, later)
