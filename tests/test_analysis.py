"""Numbers of the latent analysis (rdlm/analysis): recording, PCA, convergence, dynamics, path independence."""

import math

import numpy as np
import pytest
import torch

from rdlm import load_pretrained
from rdlm.analysis import (
    DynamicsThresholds, classify, classify_trajectory, convergence, count_labels, fit_pca, path_independence,
    project_trajectory, record, record_trajectory, spread_over_runs, trajectory_pca,
)
from rdlm.analysis.dynamics import FIXED_POINT, ORBIT, SLIDER
from rdlm.analysis.pca import plane_alignment

HIDDEN = 16



def orthonormal(rows: int, dim: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(dim, rows, generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64))
    return q.T  # [rows, dim]


# Toy recurrences on [1, tokens, HIDDEN] states: the three behaviours of paper section 6.
CENTRE = torch.linspace(-1, 1, HIDDEN, dtype=torch.float64)


def contracting(state, i):
    return 0.6 * state + 0.4 * CENTRE   # fixed point at CENTRE


PLANE = orthonormal(2, HIDDEN, seed=3)


def rotating(state, i):
    # Rotate by 2*pi/7 inside PLANE around CENTRE; the orthogonal complement is left alone.
    x = state - CENTRE
    coords = x @ PLANE.T                           # [..., 2]
    c, s = math.cos(2 * math.pi / 7), math.sin(2 * math.pi / 7)
    rotated = torch.stack((c * coords[..., 0] - s * coords[..., 1], s * coords[..., 0] + c * coords[..., 1]), -1)
    return CENTRE + x - coords @ PLANE + rotated @ PLANE


DRIFT = orthonormal(1, HIDDEN, seed=5)[0]


def drifting(state, i):
    wobble = 0.05 * math.sin(i) * PLANE[0]        # a little sideways motion on a steady drift
    return state + 0.3 * DRIFT + wobble


def start(tokens=5, seed=0):
    return 2 * torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --------------------------------------------------------------------------------------------------
# Recording

def test_recorded_trajectory_matches_forward_trajectory(tiny_model):
    ids = torch.arange(1, 9)
    s0 = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(1))
    traj = record_trajectory(tiny_model, ids, 5, initial_state=s0)
    with torch.no_grad():
        ref = tiny_model(ids[None], num_steps=5, initial_state=s0, return_trajectory=True).trajectory
    assert traj.states.shape == (8, 6, 64)
    assert traj.iterations.tolist() == list(range(6))
    for i, state in enumerate(ref):
        np.testing.assert_allclose(traj.states[:, i], state[0].numpy(), atol=1e-6)
    assert traj.token_ids.tolist() == ids.tolist()
    assert traj.storage == ["in memory (0.0 MiB)"]


def test_limit_state_is_the_state_after_limit_steps(tiny_model):
    ids = torch.arange(3, 10)
    traj = record_trajectory(tiny_model, ids, 3, limit_steps=9, seed=4)
    longer = record_trajectory(tiny_model, ids, 9, seed=4)
    np.testing.assert_allclose(traj.limit, longer.states[:, -1], atol=1e-6)
    np.testing.assert_allclose(traj.states, longer.states[:, :4], atol=1e-6)


def test_streaming_to_disk_gives_the_same_states(tiny_model, tmp_path):
    ids = torch.arange(1, 7)
    in_memory = record_trajectory(tiny_model, ids, 4, seed=2)
    streamed = record_trajectory(tiny_model, ids, 4, seed=2, stream_to=tmp_path / "s.npy")
    assert isinstance(streamed.states, np.memmap)
    assert any("streamed to disk" in note for note in streamed.storage)
    np.testing.assert_array_equal(np.load(tmp_path / "s.npy"), in_memory.states)
    assert not list(tmp_path.glob("*.partial"))


def test_memory_budget_subsamples_iterations_and_says_so():
    # 5 tokens x 16 hidden x 4 bytes = 320 bytes per iteration; a budget of 5 iterations for r = 40.
    traj = record(contracting, start(), 40, max_bytes=5 * 320)
    assert traj.states.nbytes <= 5 * 320
    assert traj.iterations[0] == 0 and traj.iterations[-1] == 40
    assert any("iterations subsampled" in note for note in traj.storage)
    full = record(contracting, start(), 40)
    np.testing.assert_allclose(traj.states, full.states[:, traj.iterations], atol=1e-6)


def test_token_subsampling_keeps_chosen_positions_and_says_so(tiny_model):
    traj = record_trajectory(tiny_model, torch.arange(1, 21), 3, max_tokens=5)
    assert traj.positions.tolist() == [0, 5, 10, 14, 19]
    assert traj.states.shape[0] == 5
    assert any("5 of 20 positions" in note for note in traj.storage)


def test_bad_inputs_are_named(tiny_model):
    with pytest.raises(ValueError, match="vocabulary"):
        record_trajectory(tiny_model, [1, 2, 10_000], 2)
    with pytest.raises(ValueError, match="no tokens"):
        record_trajectory(tiny_model, [], 2)
    with pytest.raises(ValueError, match="limit_steps"):
        record_trajectory(tiny_model, [1, 2], 4, limit_steps=2)
    with pytest.raises(ValueError, match="positions"):
        record_trajectory(tiny_model, [1, 2], 2, positions=[5])


# --------------------------------------------------------------------------------------------------
# PCA

def test_pca_recovers_a_planted_orbit_plane():
    gen = torch.Generator().manual_seed(0)
    dim, tokens, steps = 48, 20, 30
    plane = orthonormal(2, dim, seed=11)
    offset = 5 * torch.randn(dim, generator=gen, dtype=torch.float64)
    blocks = []
    for t in range(tokens):
        phase = 2 * math.pi * t / tokens
        angles = phase + 2 * math.pi * torch.arange(steps, dtype=torch.float64) / 9
        circle = 3 * torch.stack((angles.cos(), angles.sin()), -1)          # radius 3 orbits
        noise = 0.05 * torch.randn(steps, dim, generator=gen, dtype=torch.float64)
        blocks.append((offset + circle @ plane + noise).numpy())
    pca = fit_pca(blocks, num_components=6)
    assert plane_alignment(pca.components[:2], plane.numpy()) > 0.999
    assert pca.explained_ratio[:2].sum() > 0.95
    np.testing.assert_allclose(pca.components @ pca.components.T, np.eye(6), atol=1e-10)
    # Projected points lie on the radius-3 circle.
    radius = np.linalg.norm(pca.project(np.concatenate(blocks))[:, :2], axis=-1)
    assert abs(radius.mean() - 3) < 0.05


def test_pca_matches_numpy_svd_on_a_trajectory():
    traj = record(rotating, start(6), 20)
    pca = trajectory_pca(traj, num_components=4)
    rows = traj.states.reshape(-1, HIDDEN).astype(np.float64)
    _, singular, vt = np.linalg.svd(rows - rows.mean(0), full_matrices=False)
    np.testing.assert_allclose(np.abs(pca.components), np.abs(vt[:4]), atol=1e-4)
    np.testing.assert_allclose(pca.explained_variance, singular[:4] ** 2 / (rows.shape[0] - 1), rtol=1e-4)
    assert project_trajectory(traj, pca).shape == (6, 21, 4)


# --------------------------------------------------------------------------------------------------
# Convergence and dynamics

def test_convergence_of_a_contracting_map_is_geometric():
    traj = record(contracting, start(), 12, limit_steps=200)
    np.testing.assert_allclose(traj.limit, np.broadcast_to(CENTRE.numpy(), traj.limit.shape), atol=1e-9)
    conv = convergence(traj)
    ratio = conv.distance[:, 1:] / conv.distance[:, :-1]
    np.testing.assert_allclose(ratio, 0.6, rtol=1e-3)
    assert conv.relative_change.shape == (5, 12)
    assert conv.summary()["relative_distance_to_limit_at_r"]["max"] < 1e-2


def test_convergence_needs_a_limit_state():
    with pytest.raises(ValueError, match="limit"):
        convergence(record(contracting, start(), 4))


@pytest.mark.parametrize("step, label", [(contracting, FIXED_POINT), (rotating, ORBIT), (drifting, SLIDER)])
def test_toy_recurrences_get_their_dynamics_label(step, label):
    traj = record(step, start(), 32)
    dynamics = classify_trajectory(traj)
    assert [d.label for d in dynamics] == [label] * 5
    assert count_labels(dynamics)[label] == 5


def test_dynamics_metrics_mean_what_they_say():
    line = np.outer(np.arange(20.0), np.ones(4))                   # straight, constant steps
    d = classify(line)
    assert d.label == SLIDER and abs(d.straightness - 1) < 1e-9 and abs(d.step_shrink - 1) < 1e-6
    still = np.ones((20, 4))
    assert classify(still).label == FIXED_POINT
    strict = DynamicsThresholds(straight_tol=1.01)                 # no path is straighter than 1
    assert classify(line, strict).label == ORBIT
    with pytest.raises(ValueError, match="iterations"):
        classify(np.ones((2, 4)))


# --------------------------------------------------------------------------------------------------
# Path independence

def test_contracting_map_is_path_independent():
    initial = 3 * torch.randn(4, 5, HIDDEN, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = spread_over_runs(contracting, initial, 60, path_positions=[0, 2])
    assert result.relative_spread[:, 0].min() > 0.1
    assert result.spread[:, -1].max() < 1e-9
    # The spread shrinks by the contraction factor every iteration.
    np.testing.assert_allclose(result.spread[:, 1:20] / result.spread[:, :19], 0.6, rtol=1e-6)
    assert result.paths.shape == (4, 2, 61, HIDDEN)
    np.testing.assert_allclose(result.paths[:, :, 0], initial[:, [0, 2]].numpy(), atol=1e-6)
    sparse = spread_over_runs(contracting, initial, 60, path_positions=[2], path_iterations=[0, 30, 60])
    assert sparse.paths.shape == (4, 1, 3, HIDDEN)
    np.testing.assert_allclose(sparse.paths[:, 0], result.paths[:, 1, [0, 30, 60]], atol=1e-6)


def test_rotation_keeps_the_spread_of_its_runs():
    initial = torch.randn(3, 2, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result = spread_over_runs(rotating, initial, 14)
    np.testing.assert_allclose(result.spread[:, -1], result.spread[:, 0], rtol=1e-9)  # isometry


def test_model_path_independence_numbers(tiny_model):
    ids = torch.arange(1, 9)
    result = path_independence(tiny_model, ids, 6, num_runs=3, path_positions=[0, 7])
    assert result.spread.shape == (8, 7)
    assert result.relative_spread[:, 0].min() > 0.1      # random s_0 differ
    assert 0 <= result.argmax_agreement <= 1
    same = path_independence(tiny_model, ids, 6, num_runs=2, init_scale=0.0)
    assert same.spread.max() == 0 and same.argmax_agreement == 1.0
    with pytest.raises(ValueError, match="2 runs"):
        path_independence(tiny_model, ids, 3, num_runs=1)


def test_fixture_checkpoint_trajectory_and_dynamics(huginn_tiny_dir):
    model = load_pretrained(huginn_tiny_dir).eval()
    traj = record_trajectory(model, list(range(1, 13)), 8, limit_steps=16, seed=0)
    conv = convergence(traj)
    assert np.isfinite(conv.distance).all() and conv.distance.shape == (12, 9)
    assert sum(count_labels(classify_trajectory(traj)).values()) == 12
