"""``mooncake.engine``: upstream Mooncake's classic transfer-engine module, over tent-rs.

Create a ``TransferEngine``, call ``initialize(local_hostname, metadata_server, protocol,
device_name)``, register memory, and move bytes with ``transfer_sync_write`` /
``batch_transfer_sync_read`` and friends. Return values are upstream's (0 or a negative code,
batch ids with 0 for failure); ``last_error()`` gives the reason of the last failure on the
calling thread.
"""

from mooncake import _native as _n

_m = _n.engine
__version__ = _n.__version__
SUPPORT_EFA = _m.SUPPORT_EFA
SUPPORT_HIP = _m.SUPPORT_HIP
SUPPORT_MNNVL = _m.SUPPORT_MNNVL
SUPPORT_MUSA = _m.SUPPORT_MUSA
SUPPORT_INTRA_NVLINK = _m.SUPPORT_INTRA_NVLINK
SUPPORT_CUDA = _m.SUPPORT_CUDA
TransferOpcode = _m.TransferOpcode
Read = _m.Read
Write = _m.Write
TransferNotify = _m.TransferNotify
TransferEngine = _m.TransferEngine
InnerTransferEngine = _m.InnerTransferEngine
last_error = _m.last_error

__all__ = [
    "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL", "SUPPORT_MUSA", "SUPPORT_INTRA_NVLINK",
    "SUPPORT_CUDA", "TransferOpcode", "Read", "Write", "TransferNotify", "TransferEngine",
    "InnerTransferEngine", "last_error",
]
