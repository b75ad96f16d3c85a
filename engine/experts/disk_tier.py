"""The third memory tier: routed experts that stay in the checkpoint's safetensors files.

With `--host-mem SIZE` and a checkpoint whose routed experts exceed SIZE, the engine loads every
other weight and leaves the experts on disk. `DiskExperts` reads one expert at a time from the
files (positioned reads at the offsets in each file's header, no mmap: pages it touched would
stay resident and count against the host budget) and keeps at most SIZE of them in host memory:
the most used ones (a decayed count of lookups), since the layers are swept in order every step
and least-recently-used would evict each expert just before its next use. Each device's HBM
expert cache (expert_cache.py) fills from here, so the router-driven prefetch into HBM reaches
down to disk on a host miss.

Counters are per step (reset by the cluster): host hits and misses, bytes read from disk, and
the time the compute path waited on those reads (demand misses; prefetch reads are counted
apart).
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
import weakref
from pathlib import Path

import torch

from moectl.engine.models.config import ConfigError, ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.loader import CheckpointError, expert_tensor_names, load_model, read_experts, shard_map
from moectl.placement.topology import format_size

HALF_LIFE = 4096  # host-tier lookups after which every expert's use count is halved

# safetensors dtype names -> torch dtypes (those a checkpoint of ours can hold)
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class SafetensorsFiles:
    """Tensor name -> (file, dtype, shape, byte range), from the headers of a checkpoint's files."""

    def __init__(self, model_dir: Path):
        shards = shard_map(model_dir)
        files = sorted(set(shards.values())) if shards is not None else [model_dir / "model.safetensors"]
        self.entries: dict[str, tuple[int, torch.dtype | None, tuple[int, ...], int, int]] = {}
        self._fds: list[int] = []
        weakref.finalize(self, _close_all, self._fds)  # the descriptors go with the object
        for path in files:
            self._read_header(path)

    def _read_header(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{path.name}: cannot open ({exc.strerror})") from None
        self._fds.append(fd)
        try:
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, length, 8))
        except (struct.error, ValueError, OSError) as exc:
            raise CheckpointError(f"{path.name}: corrupt safetensors header ({exc})") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            # a non-float tensor is refused only if it is read (an expert is always a float)
            self.entries[name] = (fd, DTYPES.get(info.get("dtype")), tuple(info["shape"]), 8 + length + start,
                                  8 + length + end)

    @property
    def names(self) -> set[str]:
        return set(self.entries)

    def read(self, name: str, rows: list[int] | None = None) -> tuple[torch.Tensor, int]:
        """(the tensor, or only `rows` of its first dimension; bytes read)."""
        if name not in self.entries:
            raise CheckpointError(f"checkpoint: tensor {name} is missing")
        fd, dtype, shape, start, end = self.entries[name]
        if dtype is None:
            raise CheckpointError(f"checkpoint: tensor {name} is not a float tensor")
        if rows is None:
            spans, out_shape = [(start, end - start)], shape
        else:
            row = (end - start) // shape[0]
            spans, out_shape = [(start + r * row, row) for r in rows], (len(rows), *shape[1:])
        buf = bytearray(sum(n for _, n in spans))
        view, at = memoryview(buf), 0
        for offset, n in spans:
            got = os.preadv(fd, [view[at:at + n]], offset)
            if got != n:
                raise CheckpointError(f"checkpoint: tensor {name} is truncated on disk")
            at += n
        return torch.frombuffer(buf, dtype=dtype).reshape(out_shape), len(buf)

    def numel(self, name: str) -> int:
        return math.prod(self.entries[name][2])


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


class DiskExperts:
    """The host tier in front of disk: at most `capacity_bytes` of experts in memory."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, capacity_bytes: int):
        self.files = SafetensorsFiles(Path(model_dir))
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.expert_bytes = one_expert_bytes(cfg)
        self.disk_bytes = routed_expert_bytes(cfg)
        if capacity_bytes < self.expert_bytes:
            raise ConfigError(f"--host-mem: {format_size(capacity_bytes)} is smaller than one expert "
                              f"({format_size(self.expert_bytes)})")
        self.capacity = capacity_bytes // self.expert_bytes
        self._check_sizes()
        self.cached: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.uses: dict[tuple[int, int], float] = {}  # lookups per expert, halved every HALF_LIFE lookups
        self._lookups = 0
        self.reset_stats()

    def _check_sizes(self) -> None:
        """Every MoE layer's expert tensors hold exactly num_experts experts of the config's shape
        (from the headers alone), so a mismatch is one line at load, not a failure mid-serving."""
        cfg, names = self.cfg, self.files.names
        want = cfg.num_experts * (self.expert_bytes // cfg.dtype.itemsize)
        for layer, sparse in enumerate(cfg.sparse_layers):
            if not sparse:
                continue
            tensors = expert_tensor_names(cfg, layer, names)
            missing = [t for t in tensors if t not in names]
            if missing:
                raise CheckpointError(f"checkpoint: tensor {missing[0]} is missing")
            got = sum(self.files.numel(t) for t in tensors)
            if got != want:
                raise CheckpointError(f"checkpoint: layer {layer}'s experts hold {got:,} values, the config's shapes "
                                      f"{want:,} ({tensors[0]} and the rest)")

    def reset_stats(self) -> None:
        self.hits = self.misses = self.bytes_read = self.reads = self.prefetch_reads = 0
        self.wait_s = self.prefetch_s = 0.0

    def fetch(self, layer: int, expert: int, demand: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of one expert in the engine's layout, from host memory or read from disk."""
        key = (layer, expert)
        self.uses[key] = self.uses.get(key, 0.0) + 1.0
        self._lookups += 1
        if self._lookups % HALF_LIFE == 0:  # old popularity fades, so a shift in routing is followed
            self.uses = {k: v / 2 for k, v in self.uses.items()}
        if key in self.cached:
            self.hits += 1
            return self.cached[key]
        self.misses += 1
        t0 = time.perf_counter()
        read = 0

        def get(name: str, rows=None) -> torch.Tensor:
            nonlocal read
            tensor, n = self.files.read(name, [expert] if rows is not None else None)
            read += n
            return tensor

        w13, w2 = read_experts(self.cfg, layer, self.files.names, get, [expert])
        pair = (w13[0].to(self.dtype).contiguous(), w2[0].to(self.dtype).contiguous())
        elapsed = time.perf_counter() - t0
        if demand:
            self.wait_s += elapsed
        else:  # a prefetch into an HBM cache that missed here too: the read ran ahead of compute
            self.prefetch_s += elapsed
            self.prefetch_reads += 1
        self.bytes_read += read
        self.reads += 1
        if len(self.cached) >= self.capacity:
            # keep the most used experts: layers are swept in order every step, so least-recently-used
            # would evict each expert just before its next use once the host holds less than a sweep
            coldest = min(self.cached, key=self.uses.__getitem__)
            if self.uses[coldest] >= self.uses[key]:
                return pair  # no more used than anything held: serve it without caching
            del self.cached[coldest]
        self.cached[key] = pair
        return pair

    def stats(self) -> dict:
        """This step's counters for the step record's tiers."""
        return {"host": {"expert_weights": len(self.cached) * self.expert_bytes,
                         "capacity": self.capacity * self.expert_bytes, "hits": self.hits, "misses": self.misses},
                "disk": {"expert_weights": self.disk_bytes, "reads": self.reads, "prefetch_reads": self.prefetch_reads,
                         "bytes_read": self.bytes_read, "wait_s": self.wait_s, "prefetch_s": self.prefetch_s}}


def one_expert_bytes(cfg: ModelConfig) -> int:
    """One routed expert in memory (w13 and w2, biases included), from the config."""
    h, i = cfg.hidden_size, cfg.expert_intermediate_size
    extra = 1 if cfg.expert_bias else 0
    return (2 * i * (h + extra) + h * (i + extra)) * cfg.dtype.itemsize


def routed_expert_bytes(cfg: ModelConfig) -> int:
    """All routed experts of a checkpoint in memory."""
    return one_expert_bytes(cfg) * cfg.num_experts * sum(cfg.sparse_layers)


def load_with_disk_tier(model_dir: str, dtype, device, host_mem: int) -> MoEForCausalLM:
    """The model with its routed experts left on disk behind a host tier of host_mem bytes, when
    they exceed it; otherwise the whole model (everything fits in host memory)."""
    cfg = ModelConfig.from_dir(model_dir, dtype=dtype)
    if routed_expert_bytes(cfg) <= host_mem:
        return load_model(model_dir, dtype=dtype, device=device)
    disk = DiskExperts(model_dir, cfg, host_mem)  # refuses a host_mem below one expert before loading
    model = load_model(model_dir, dtype=dtype, device=device, experts=False)
    model.disk_experts = disk
    return model
