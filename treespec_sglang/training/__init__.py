"""Draft training: objectives (KL, TALF, LK), self-distillation data, TALF target trees, token maps and loops."""

from .losses import (acceptance_rate, kl_loss, lk_alpha_loss, lk_lambda, lk_lambda_loss, multi_step_loss, talf_loss,
                     ttt_weights)

__all__ = ["acceptance_rate", "kl_loss", "lk_alpha_loss", "lk_lambda", "lk_lambda_loss", "multi_step_loss",
           "talf_loss", "ttt_weights"]
