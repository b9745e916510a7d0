"""Training: AdamW + schedule, the one train() loop, run logs, pretrain(), finetune() (duolm.train.finetune).
The objectives (losses) live in duolm.objectives and are re-exported here."""
from duolm.objectives import CAUSAL_LM, IGNORE, MLM_NSP, Objective, causal_lm_loss, mlm_nsp_loss
from duolm.train.loop import TrainConfig, evaluate, load_train_state, loss_validator, save_checkpoint, train, train_step
from duolm.train.optim import lr_at, make_optimizer, param_groups
from duolm.train.parallel import process_group, setup_distributed
from duolm.train.pretrain import ModelConfig, pretrain

__all__ = ["TrainConfig", "train", "train_step", "evaluate", "loss_validator", "save_checkpoint", "load_train_state",
           "Objective", "CAUSAL_LM", "MLM_NSP", "IGNORE", "causal_lm_loss", "mlm_nsp_loss", "lr_at",
           "make_optimizer", "param_groups", "ModelConfig", "pretrain", "setup_distributed",
           "process_group"]
