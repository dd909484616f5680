"""The on-disk contract, in one place: schemes (``schemes``), dialects (``dialects``), exclusion lists
and engine matchers (``exclusions``), the manifest (``manifest``) and format detection (``detect``).

Pure data and small pure functions: no I/O, and no torch import at module level.
"""
