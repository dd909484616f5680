"""Trainer-side refit API: ``qconvert.refit.refit(...)`` and ``stage_refit(...)``.

The implementation lives in :mod:`qconvert.loaders.refit`; this module is the public name.
"""

from .loaders.refit import RefitResult, refit, stage_refit

__all__ = ["refit", "stage_refit", "RefitResult"]
