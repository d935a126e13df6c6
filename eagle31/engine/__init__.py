"""Disaggregated features (`features.mode=engine`): inference workers on Ray feed the trainers (docs/engine.md)."""
