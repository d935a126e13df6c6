"""eagle31: train EAGLE 3.1 speculative-decoding drafters and ship them for vLLM.

Public API (see README.md):

    DrafterConfig          everything that defines a drafter (config.py)
    Eagle31Drafter         the drafter; drafter(aux, input_ids, ttt_length=K) -> per-step logits
    ttt_unroll             the K-step training-time-test unroll (ttt.py)
    TargetHead, supervision_mask, ttt_loss, step_scales, weighted_loss, ttt_metrics   the loss (loss.py)
    build_draft_vocab      d2t / t2d from token counts (vocab.py)
"""

from eagle31.config import DrafterConfig
from eagle31.errors import ConfigError
from eagle31.loss import StepStats, TargetHead, step_scales, supervision_mask, ttt_loss, ttt_metrics, weighted_loss
from eagle31.model import Eagle31Drafter
from eagle31.ttt import TTTOutput, ttt_unroll
from eagle31.vocab import build_draft_vocab, count_supervised_tokens

__all__ = [
    "ConfigError",
    "DrafterConfig",
    "Eagle31Drafter",
    "StepStats",
    "TTTOutput",
    "TargetHead",
    "build_draft_vocab",
    "count_supervised_tokens",
    "supervision_mask",
    "step_scales",
    "ttt_loss",
    "ttt_metrics",
    "ttt_unroll",
    "weighted_loss",
]
