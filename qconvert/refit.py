"""Trainer-side refit API: ``qconvert.refit.refit(...)`` and ``stage_refit(...)``.

The implementation lives in :mod:`qconvert.trainer.refit`; this module is the public name.
"""

from .trainer.refit import RefitResult, refit, stage_refit

__all__ = ["refit", "stage_refit", "RefitResult"]
