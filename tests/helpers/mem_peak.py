"""The tests' name for ``vllm_dsbd.testing.mem_peak`` (torch's CPU allocator peak while a function runs)."""
from vllm_dsbd.testing.mem_peak import peak_bytes

__all__ = ["peak_bytes"]
