"""Online features: the target in the trainer's process computes them, nothing goes to disk (docs/data.md, Batches)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from eagle31.data.batch import Sample
from eagle31.data.capture import prepared_rows, run_target
from eagle31.data.store import prepared_lengths
from eagle31.target import TargetFeatures


class OnlineFeatures:
    """A `FeatureSource` over a prepared split (sample ids: its rows, as in a store), computed by the target."""

    def __init__(self, model: nn.Module, dataset, aux_layer_ids: Sequence[int], *, batch_tokens: int = 8192):
        """model: the target (eval mode, on its device); batch_tokens: padded tokens per target forward."""
        self.dataset, self.batch_tokens = dataset, batch_tokens
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
