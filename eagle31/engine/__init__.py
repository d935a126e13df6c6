"""Disaggregated features (`features.mode=engine`): inference workers on Ray feed the torchrun trainers.

`cluster` joins or starts Ray, `worker` computes the target's features, `pool` plans and hands them out,
`transport` carries them, `features` is the trainers' side, `capacity` sizes the workers (docs/engine.md).
"""
