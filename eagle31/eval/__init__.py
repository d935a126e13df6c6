"""Evaluation: what a drafter buys, measured by speculative decoding with the target.

drafting           the drafter at inference (a step on a step-0 KV cache; chains, EAGLE-2 trees)
speculative        greedy speculative decoding with the HF target (chain / tree verification)
acceptance         acceptance length per drafter and split; acceptance_report its JSON, table, plot
mtbench            MT-Bench acceptance: both turns, per category, chains and trees
drift              attention drift per draft depth; drift_report its JSON, table, plots
"""
