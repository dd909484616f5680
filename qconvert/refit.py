"""Trainer-side refit API: ``qconvert.refit.Refitter`` (persistent staging area, stage/commit/reload),
and the one-call ``refit(...)`` / ``stage_refit(...)``.

The implementation lives in :mod:`qconvert.trainer.refit`; this module is the public name.
"""

from .trainer.refit import RefitError, RefitResult, Refitter, Staged, refit, stage_refit

__all__ = ["Refitter", "refit", "stage_refit", "RefitResult", "RefitError", "Staged"]
