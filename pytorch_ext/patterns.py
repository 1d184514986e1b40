"""Attention patterns (placeholder, being written)."""
