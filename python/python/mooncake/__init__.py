"""Mooncake's Python API over tent-rs: ``from mooncake.engine import TransferEngine``."""

from mooncake._native import __version__  # noqa: F401
