"""The GPU tier: entries kept in device memory under a byte budget, least recently used out. A link reading them
moves nothing over PCIe; it sits in front of host memory in a tiered store (`open_store("gpu+memory+disk:...")`),
whose hits in slower tiers fill it."""

from __future__ import annotations

import torch

from .crossing import to_device
from .entry import ChunkKV
from .errors import StoreError
from .memory import MemoryStore, on_cuda, url_budget

DEFAULT_FREE_FRACTION = 0.25  # of the device memory free when the tier opens: the rest is the model's and its caches'


def device_budget(device: torch.device, fraction: float = DEFAULT_FREE_FRACTION) -> int:
    """A sane default budget: a fraction of what the device has free now (after the model loaded)."""
    if device.type != "cuda":
        raise StoreError(
            f"a GPU tier needs a CUDA device; {device} has no free-memory figure to size it by: "
            "give its budget in bytes"
        )
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * fraction)


class DeviceStore(MemoryStore):
    name = "gpu"
    lasting = False
    takes_device_entries = True  # a compile's entry is kept as it was made

    def __init__(
        self,
        device: str | torch.device = "cuda",
        budget_bytes: int | None = None,
        record_budget_bytes: int | None = None,
        free_fraction: float = DEFAULT_FREE_FRACTION,
    ):
        """`budget_bytes` None: `free_fraction` of the device memory free now."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise StoreError(
                "a GPU tier (store 'gpu') needs a CUDA device, and torch sees none here; drop 'gpu+' from the store URL"
            )
        budget = device_budget(self.device, free_fraction) if budget_bytes is None else budget_bytes
        if budget_bytes is not None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if budget_bytes > free:
                raise StoreError(
                    f"a GPU tier of {budget_bytes / (1 << 30):.1f} GiB does not fit the {free / (1 << 30):.1f} GiB "
                    f"free on {self.device}: give a smaller size, or a share such as gpu:25%"
                )
        super().__init__(budget, record_budget_bytes)

    @classmethod
    def from_url(cls, spec: str, connect: bool = True, device=None) -> DeviceStore:
        """`gpu`, `gpu:SIZE` or `gpu:N%`, on the engine's device (which must be CUDA's)."""
        size, fraction = url_budget(spec, share=True)
        if device is not None and not on_cuda(device):
            raise StoreError(
                f"a 'gpu' store tier needs the engine on a CUDA device, not {device}; drop 'gpu+' from the store URL"
            )
        return cls(device or "cuda", size, free_fraction=fraction or DEFAULT_FREE_FRACTION)

    def put_many(self, items: dict[str, ChunkKV]) -> None:
        """Those within the budget copied to the device; the others are counted and left out as MemoryStore does, and
        so is one the device has no memory for now (what else runs there is not counted in the budget)."""
        moved, out_of_memory = {}, 0
        for key, entry in items.items():
            try:
                moved[key] = to_device(entry, self.device) if entry.nbytes <= self.budget_bytes else entry
            except torch.OutOfMemoryError:
                out_of_memory += 1
        super().put_many(moved)
        with self._lock:
            self._unkept(out_of_memory)

    def stats(self) -> dict:
        return {**super().stats(), "device": str(self.device)}
