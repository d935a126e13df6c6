"""Evaluation: what a drafter buys, measured by speculative decoding with the target (docs/evaluation.md)."""
