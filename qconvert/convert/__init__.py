"""Conversion: numerics and layouts (pure tensor functions), plan, dialects, pipeline (I/O)."""
