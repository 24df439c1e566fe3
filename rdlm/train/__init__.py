"""Training machinery, apart from the model (torchtitan style): optimizer, schedule, checkpoints,
distributed setup, monitoring and the loop. Entry point: `train(TrainConfig(...), ...)`."""

from rdlm.train.config import TrainConfig
from rdlm.train.trainer import Trainer, TrainingError, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "Trainer", "TrainingError", "train"]
