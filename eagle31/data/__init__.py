"""Data: conversations -> tokens + loss masks, target capture, shard store, batches."""
