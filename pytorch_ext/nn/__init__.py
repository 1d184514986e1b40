"""attnkit.nn: drop-in attention layers built on the attnkit ops (MultiheadAttention, sparse,
linear and Hopfield layers arrive with their kernel issues)."""
