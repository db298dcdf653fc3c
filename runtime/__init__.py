"""The Vulkan runtime: devices, memory, pipelines and recorded command sequences.

Only `vk.py` touches the cffi binding; everything else goes through it.
"""

from zdsl.runtime.device import Device, list_devices, open_device
from zdsl.runtime.memory import Buffer, HostBuffer
from zdsl.runtime.physical import DeviceInfo
from zdsl.runtime.pipeline import Pipeline
from zdsl.runtime.sequence import Sequence

__all__ = ["open_device", "list_devices", "Device", "DeviceInfo", "Buffer", "HostBuffer", "Pipeline", "Sequence"]
