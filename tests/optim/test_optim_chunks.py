"""The CPU chunk size of LAMB/LARS comes from the cache sizes the machine reports in sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaleout.optim import chunks

pytestmark = pytest.mark.unit


def fake_sysfs(root: Path, caches: list[tuple[int, str, str, str]]) -> Path:
    """cpu0/cache/index*/{level,type,size,shared_cpu_list} as Linux writes them."""
    for i, (level, kind, size, shared) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        for name, value in (
            ("level", str(level)),
            ("type", kind),
            ("size", size),
            ("shared_cpu_list", shared),
        ):
            (d / name).write_text(value + "\n")
    return root


EPYC = [
    (1, "Data", "32K", "0"),
    (1, "Instruction", "32K", "0"),
    (2, "Unified", "1024K", "0"),
    (3, "Unified", "32768K", "0-1"),
]
# Sapphire Rapids, one socket as bare metal reports it: 2 MiB L2 per core, 105 MiB L3 shared by 56
# cores
SPR = [
    (1, "Data", "48K", "0"),
    (1, "Instruction", "32K", "0"),
    (2, "Unified", "2048K", "0"),
    (3, "Unified", "107520K", "0-55"),
]


def test_reads_sysfs_and_follows_the_cache_sizes(tmp_path: Path) -> None:
    epyc = chunks.cache_levels(fake_sysfs(tmp_path / "epyc", EPYC))
    assert epyc == {
        1: (32 << 10, 1),
        2: (1 << 20, 1),
        3: (32 << 20, 2),
    }  # instruction cache left out
    # 1 MiB L2 + 32 MiB / 2 CPUs = 17 MiB for 7 fp32 arrays -> 636k elements -> 2**19
    assert chunks.chunk_for_caches(epyc) == 1 << 19
    spr = chunks.cache_levels(fake_sysfs(tmp_path / "spr", SPR))
    assert spr[3] == (105 << 20, 56)
    # 2 MiB + 105 MiB / 56 = 3.9 MiB -> 146k elements -> 2**17: smaller caches per core, smaller
    # chunks
    assert chunks.chunk_for_caches(spr) == 1 << 17
    bigger = chunks.cache_levels(
        fake_sysfs(tmp_path / "big", [(2, "Unified", "2M", "0"), (3, "Unified", "256M", "0-1")])
    )
    assert chunks.chunk_for_caches(bigger) == 1 << 22
    tiny = chunks.cache_levels(fake_sysfs(tmp_path / "tiny", [(2, "Unified", "256K", "0-1")]))
    assert (
        chunks.chunk_for_caches(tiny) == chunks.MIN_CPU_CHUNK
    )  # per-op overhead bounds it from below


def test_fallback_when_nothing_is_reported(tmp_path: Path) -> None:
    assert chunks.cache_levels(tmp_path / "missing") == {}
    assert chunks.chunk_for_caches({}) == chunks.FALLBACK_CPU_CHUNK
    only_l1 = chunks.cache_levels(fake_sysfs(tmp_path / "l1", [(1, "Data", "32K", "0")]))
    assert chunks.chunk_for_caches(only_l1) == chunks.FALLBACK_CPU_CHUNK
    broken = fake_sysfs(tmp_path / "broken", [(2, "Unified", "lots", "0")])
    assert chunks.cache_levels(broken) == {}


def test_this_machine_uses_its_own_caches() -> None:
    expected = chunks.chunk_for_caches(chunks.cache_levels(chunks.SYSFS_CACHE))
    assert chunks.default_chunk(torch.device("cpu")) == expected
    assert chunks.default_chunk(torch.device("meta")) is None  # accelerators: whole tensors
