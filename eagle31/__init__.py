"""eagle31: train EAGLE 3.1 speculative-decoding drafters and ship them for vLLM; the public API is `__all__`."""

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
