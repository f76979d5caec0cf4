"""Type stubs of mooncake.engine (tent-rs): upstream Mooncake's classic transfer-engine module."""

import enum
from typing import Any, List, Optional, Protocol, Sequence, Union

class _HasDataPtr(Protocol):
    def data_ptr(self) -> int: ...

# An address: an int, an object with data_ptr() (a CPU torch tensor), or an object with the
# buffer protocol (bytearray, memoryview, numpy arrays), whose length is then checked.
Address = Union[int, _HasDataPtr, bytearray, memoryview, Any]

__version__: str  # tent-rs's version, the same in every package
SUPPORT_EFA: bool
SUPPORT_HIP: bool
SUPPORT_MNNVL: bool
SUPPORT_MUSA: bool
SUPPORT_INTRA_NVLINK: bool
SUPPORT_CUDA: bool

class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1

Read: TransferOpcode
Write: TransferOpcode

class TransferNotify:
    name: str
    msg: str
    def __init__(self, name: str = "", msg: str = "") -> None: ...

class InnerTransferEngine: ...

def last_error() -> str:
    """The reason of the last failure this module reported with a return code on this thread."""

class TransferEngine:
    TransferOpcode = TransferOpcode
    def __init__(self) -> None: ...
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: Optional[str]) -> int: ...
    def initialize_ext(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: Optional[str], metadata_type: str
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def allocate_managed_buffer(self, length: int) -> int: ...
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int: ...
    def transfer_sync_write(
        self, target_hostname: str, buffer: Address, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int: ...
    def transfer_sync_read(
        self, target_hostname: str, buffer: Address, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int: ...
    def batch_transfer_sync_write(
        self, target_hostname: str, buffers: Sequence[Address], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync_read(
        self, target_hostname: str, buffers: Sequence[Address], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async_write(
        self, target_hostname: str, buffers: Sequence[Address], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async_read(
        self, target_hostname: str, buffers: Sequence[Address], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], transport_hint: str = "",
    ) -> int: ...
    def transfer_sync(
        self, target_hostname: str, buffer: Address, peer_buffer_address: int, length: int,
        opcode: TransferOpcode, notify: Optional[TransferNotify] = None, transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync(
        self, target_hostname: str, buffers: Sequence[Address], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], opcode: TransferOpcode, notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async(
        self, target_hostname: str, buffers: Sequence[Address], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], opcode: TransferOpcode, transport_hint: str = "",
    ) -> int: ...
    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int: ...
    def transfer_submit_write(
        self, target_hostname: str, buffer: Address, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int: ...
    def transfer_check_status(self, batch_id: int) -> int: ...
    def get_transfer_error(self, batch_id: int, task_id: int) -> str:
        """Why the task ended without completing ("" when it did not fail) (tent-rs addition)."""
    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int: ...
    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes: ...
    def register_memory(self, buffer_addr: Address, capacity: int, location: str = "*") -> int: ...
    def unregister_memory(self, buffer_addr: Address) -> int: ...
    def batch_register_memory(
        self, buffer_addresses: Sequence[Address], capacities: Sequence[int], location: str = "*"
    ) -> int: ...
    def batch_unregister_memory(self, buffer_addresses: Sequence[Address]) -> int: ...
    def get_local_topology(self, device_name: Optional[str] = None) -> str: ...
    def get_first_buffer_address(self, segment_name: str) -> int: ...
    def warmup_efa_segment(self, segment_name: str) -> int: ...
    def get_notifies(self) -> List[TransferNotify]: ...
    def send_probe(self, peer_server_name: str) -> int: ...
    def get_engine(self) -> InnerTransferEngine: ...
    def get_engine_ptr(self) -> int: ...
    def close(self) -> None:
        """Stops the engine now (tent-rs addition)."""
    def transfer_write_on_cuda(self, *args: Any, **kwargs: Any) -> None:
        """Raises RuntimeError: no CUDA in this build."""
    def transfer_read_on_cuda(self, *args: Any, **kwargs: Any) -> None:
        """Raises RuntimeError: no CUDA in this build."""
    def batch_transfer_write_on_cuda(self, *args: Any, **kwargs: Any) -> None:
        """Raises RuntimeError: no CUDA in this build."""
    def batch_transfer_read_on_cuda(self, *args: Any, **kwargs: Any) -> None:
        """Raises RuntimeError: no CUDA in this build."""
