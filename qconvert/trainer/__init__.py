"""Trainer side: refit (convert a trainer's weights and hot-reload them); public entry point
:mod:`qconvert.refit`."""
