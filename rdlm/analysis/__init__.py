"""Looking inside a recurrent-depth model: what the latent state does while it iterates (paper section 6).

- `trajectories`: record s_0..s_r per token (in memory, streamed to disk, or subsampled)
- `pca`: PCA over all tokens' trajectories (Figure 6)
- `convergence`: ||s_i - s*|| per token and iteration (Figure 5)
- `dynamics`: fixed point / orbit / slider labels
- `path_independence`: spread over random initial states
- `exit_steps`: per-token exit steps under an exit criterion (Figure 4)
- `plots`, `report`: PNG figures and a self-contained HTML report
- `run.analyze`: all of the above for a set of prompts (what `rdlm analyze` calls)
"""

from rdlm.analysis.convergence import Convergence, convergence
from rdlm.analysis.dynamics import Dynamics, DynamicsThresholds, classify, classify_trajectory, count_labels
from rdlm.analysis.path_independence import PathIndependence, path_independence, spread_over_runs
from rdlm.analysis.pca import PCA, fit_pca, project_trajectory, trajectory_pca
from rdlm.analysis.run import AnalysisResult, AnalysisSettings, Prompt, analyze
from rdlm.analysis.trajectories import Trajectory, record, record_trajectory

__all__ = [
    "PCA",
    "AnalysisResult",
    "AnalysisSettings",
    "Convergence",
    "Dynamics",
    "DynamicsThresholds",
    "PathIndependence",
    "Prompt",
    "Trajectory",
    "analyze",
    "classify",
    "classify_trajectory",
    "convergence",
    "count_labels",
    "fit_pca",
    "path_independence",
    "project_trajectory",
    "record",
    "record_trajectory",
    "spread_over_runs",
    "trajectory_pca",
]
