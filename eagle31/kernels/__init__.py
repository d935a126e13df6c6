"""The attention of the training-time-test unroll (docs/design.md §4).

ttt_attention      one TTT step: the causal step-0 keys + the query's own chain, merged by log-sum-exp
kernels            the causal part (flash, blockwise), documents' segment ids, the backend choice
entries            what a step keeps (its entry) and how keys and values are made of it
"""
