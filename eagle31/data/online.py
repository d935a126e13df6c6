"""Online features: the target runs inside the trainer's process, nothing goes to disk.

`OnlineFeatures` is a `FeatureSource` over a prepared split (columns `input_ids`,
`loss_mask`): sample ids are the split's rows, as in a store captured from it,
so `FeatureLoader(OnlineFeatures(...), seed=s)` yields the batches that
`FeatureLoader(FeatureStore(...), seed=s)` yields. The features are equal up to
float rounding of differently shaped target forwards (bit-identical when both
sides run one sample per forward, `batch_tokens=1`).

For targets that fit beside the drafter on each rank; use the store otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from eagle31.data.batch import Sample
from eagle31.data.capture import prepared_rows, run_target
from eagle31.data.store import prepared_lengths
from eagle31.target import TargetFeatures


class OnlineFeatures:
    """A `FeatureSource` that computes each requested sample's features with the target, in-process."""

    def __init__(self, model: nn.Module, dataset, aux_layer_ids: Sequence[int], *, batch_tokens: int = 8192):
        """model: the target (eval mode, on its device); batch_tokens: padded tokens per target forward."""
        self.dataset = dataset
        self.batch_tokens = batch_tokens
        self._feats = TargetFeatures(model, aux_layer_ids)
        head = model.get_output_embeddings().weight  # [V, Ht]
        self.hidden_size = head.shape[1]
        self.aux_size = len(self._feats.aux_layer_ids) * self.hidden_size
        self.dtype = head.dtype
        self.lengths = prepared_lengths(dataset)
        self.sample_ids = np.arange(len(self.lengths))

    def samples(self, ids: Sequence[int]) -> list[Sample]:
        with self._feats:  # hooks live only during this call; the target stays usable elsewhere
            return run_target(self._feats, prepared_rows(self.dataset, ids), self.batch_tokens)
