"""Training: objectives (losses), AdamW + schedule, the one train() loop, run logs."""
from duolm.train.loop import TrainConfig, evaluate, read_manifest, save_checkpoint, train
from duolm.train.objectives import CAUSAL_LM, IGNORE, MLM_NSP, Objective, causal_lm_loss, mlm_nsp_loss
from duolm.train.optim import lr_at, make_optimizer, param_groups

__all__ = ["TrainConfig", "train", "evaluate", "save_checkpoint", "read_manifest", "Objective", "CAUSAL_LM",
           "MLM_NSP", "IGNORE", "causal_lm_loss", "mlm_nsp_loss", "lr_at", "make_optimizer", "param_groups"]
