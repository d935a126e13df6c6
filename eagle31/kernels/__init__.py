"""The memory-lean kernels of the TTT attention (causal.py, ttt_attention.py, entries.py)."""
