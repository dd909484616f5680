"""Transition shim: the dialects moved to :mod:`qconvert.formats.dialects` (the on-disk contract's
one home). Import from there; this module goes once no branch in flight imports it."""

from ..formats.dialects import *  # noqa: F401,F403
from ..formats.dialects import (DEFAULT_DIALECT, DIALECTS, PRODUCER, OutTensor, engines_for,  # noqa: F401
                                mxfp8_out_tensors, mxfp8_quant_config, nvfp4_out_tensors, nvfp4_quant_config,
                                resolve_dialect)
from ..formats.exclusions import ct_ignore  # noqa: F401
from ..formats.schemes import NVFP4_INPUT_MODES  # noqa: F401
