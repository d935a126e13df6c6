"""Locally built targets: the miniature Kimi K2.6 and the demo model."""
