"""Regeneration: a dataset's assistant turns answered again by the target, turn by turn (docs/regeneration.md)."""
