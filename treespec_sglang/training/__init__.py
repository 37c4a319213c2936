"""Draft training: objectives (KL, TALF, LK), data and loops (the loops arrive with the training issue)."""

from .losses import (acceptance_rate, kl_loss, lk_alpha_loss, lk_lambda, lk_lambda_loss, multi_step_loss, talf_loss,
                     ttt_weights)

__all__ = ["acceptance_rate", "kl_loss", "lk_alpha_loss", "lk_lambda", "lk_lambda_loss", "multi_step_loss",
           "talf_loss", "ttt_weights"]
