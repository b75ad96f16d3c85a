"""Cluster topology: N devices grouped into nodes, their HBM, the host and disk tiers, and links.

Given on the command line (`--devices 8 --hbm 2GiB ...`) or as a small TOML/JSON file. Link and
host-to-device bandwidths are what modeled transfer times are computed from on the local
(emulated) backend.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


class TopologyError(ValueError):
    """A topology value out of range; the message names the field."""


def parse_size(value, field: str = "size") -> int:
    """'2GiB', '512 MB', '1.5e9' or a number -> bytes."""
    if isinstance(value, bool):
        raise TopologyError(f"{field}: {value!r} is not a size")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise TopologyError(f"{field}: {value!r} is not a size (e.g. 80GiB, 512MB, 1e9)")
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * _UNITS[unit])
    if size < 0:
        raise TopologyError(f"{field}: must not be negative")
    return size


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"


MAX_DEVICES = 256  # devices (or ranks) one engine drives: past the seeds' 64-256 GPU deployments


@dataclass(frozen=True)
class Topology:
    num_devices: int = 1
    devices_per_node: int = 8
    hbm_bytes: int = 80 << 30
    host_bytes: int = 1 << 40  # host (CPU) memory tier shared by a node's devices
    disk_bytes: int = 16 << 40
    intra_node_gbps: float = 400.0  # GB/s device-to-device within a node (NVLink-class)
    inter_node_gbps: float = 50.0  # GB/s device-to-device across nodes (RDMA-class)
    host_to_device_gbps: float = 50.0  # GB/s host tier to a device (PCIe-class)
    disk_to_host_gbps: float = 5.0

    def __post_init__(self):
        if isinstance(self.num_devices, bool) or not isinstance(self.num_devices, int) \
                or not 1 <= self.num_devices <= MAX_DEVICES:
            raise TopologyError(f"devices: must be an integer in [1, {MAX_DEVICES}], got {self.num_devices!r}")
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) \
                or self.devices_per_node < 1:
            raise TopologyError(f"devices_per_node: must be a positive integer, got {self.devices_per_node!r}")
        for name in ("hbm_bytes", "host_bytes", "disk_bytes"):
            if getattr(self, name) <= 0:
                raise TopologyError(f"{name.removesuffix('_bytes')}: must be positive")
        for name in ("intra_node_gbps", "inter_node_gbps", "host_to_device_gbps", "disk_to_host_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise TopologyError(f"{name}: must be a positive number of GB/s, got {value!r}")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def link_gbps(self, src: int, dst: int) -> float:
        return self.intra_node_gbps if self.node_of(src) == self.node_of(dst) else self.inter_node_gbps

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_mapping(cls, raw: dict) -> Topology:
        """Keys as in the dataclass; sizes may be strings ('80GiB'); 'devices' and 'hbm' are accepted."""
        aliases = {"devices": "num_devices", "hbm": "hbm_bytes", "host": "host_bytes", "disk": "disk_bytes"}
        known = {f.name for f in fields(cls)}
        kw = {}
        for key, value in raw.items():
            name = aliases.get(key, key)
            if name not in known:
                raise TopologyError(f"{key}: not a topology field (fields: {', '.join(sorted(known))})")
            kw[name] = parse_size(value, key) if name.endswith("_bytes") else value
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> Topology:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise TopologyError(f"topology: cannot read {path} ({exc.strerror})") from None
        try:
            raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise TopologyError(f"topology: {path.name} is not valid {path.suffix.lstrip('.') or 'JSON'} ({exc})") from None
        if not isinstance(raw, dict):
            raise TopologyError(f"topology: {path.name} must hold a table/object")
        return cls.from_mapping(raw.get("topology", raw))
