"""Training machinery, apart from the model (torchtitan style): optimizer, schedule, checkpoints,
distributed setup, monitoring and the loop. Entry point: `train(TrainConfig(...), ...)`."""

from rdlm.train.trainer import TrainConfig, Trainer, TrainingError, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "Trainer", "TrainingError", "train"]
