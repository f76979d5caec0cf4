"""``tent``: upstream TENT's Python module, over tent-rs.

``TransferEngine(config_path)`` starts an engine; allocate or register memory, open peers'
segments, allocate batches and submit ``Request`` lists, poll ``TransferStatus``. Failures raise
subclasses of ``TentException`` carrying the engine's message. ``allocate_memory_guard`` and
``allocate_batch_guard`` return context managers that free what they hold.
"""

from mooncake import _native as _n

_m = _n.tent
__all__ = [name for name in dir(_m) if not name.startswith("_")]
globals().update({name: getattr(_m, name) for name in __all__})
__version__ = _n.__version__
