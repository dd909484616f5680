"""The on-disk contract: pure data and small pure functions."""
