"""The quality evaluation: perplexity of a held-out text and accuracy on a multiple-choice set (perf.quality_eval)."""
