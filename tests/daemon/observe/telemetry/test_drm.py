"""drm.py: fdinfo parsing, DRM cards, AMD sysfs totals and DRM fdinfo on recorded trees."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from arbiterd.daemon.observe.telemetry import (
    AmdSysfsReader,
    DeviceMemory,
    DrmFdinfoReader,
    TelemetryError,
    drm_cards,
)
from arbiterd.daemon.observe.telemetry.drm import drm_client, parse_fdinfo, parse_size
from tests.daemon.observe.telemetry.support import (
    FIXTURES,
    GiB,
    KiB,
    MiB,
    by_pid,
    copied_tree,
    name_of,
    tree,
)

# -- fdinfo parsing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("1024 KiB", MiB),
        ("16 MiB", 16 * MiB),
        ("2 GiB", 2 * GiB),
        ("12 B", 12),
        (" 8 KiB ", 8 * KiB),
        ("7 kB", None),
        ("lots", None),
        ("", None),
    ],
)
def test_sizes_parse_in_the_units_drivers_print(text: str, expected: int | None) -> None:
    assert parse_size(text) == expected


def test_amdgpu_padded_keys_parse() -> None:
    fields = parse_fdinfo("drm-driver:\tamdgpu\ndrm-memory-gtt: \t4112 KiB\nnot a field\n")
    assert fields == {"drm-driver": "amdgpu", "drm-memory-gtt": "4112 KiB"}


def test_a_non_drm_fdinfo_is_no_client() -> None:
    text = (FIXTURES / "amdgpu" / "proc" / "7171" / "fdinfo" / "0").read_text()
    assert drm_client(parse_fdinfo(text)) is None


def test_resident_beats_total_beats_the_legacy_key() -> None:
    fields = {
        "drm-driver": "amdgpu",
        "drm-pdev": "0000:03:00.0",
        "drm-client-id": "1",
        "drm-memory-vram": "100 KiB",
        "drm-total-vram": "300 KiB",
        "drm-resident-vram": "200 KiB",
    }
    client = drm_client(fields)
    assert client is not None
    assert client.device_local_bytes == 200 * KiB
    del fields["drm-resident-vram"]
    client = drm_client(fields)
    assert client is not None
    assert client.device_local_bytes == 300 * KiB
    del fields["drm-total-vram"]
    client = drm_client(fields)
    assert client is not None
    assert client.device_local_bytes == 100 * KiB


# -- DRM cards and AMD sysfs -----------------------------------------------------------------


def test_cards_are_pci_gpus_in_card_order_without_connectors_or_render_nodes() -> None:
    sysfs, _ = tree("amdgpu")
    cards = drm_cards(sysfs)
    assert [(c.card, c.pci_address, c.driver, c.device) for c in cards] == [
        (0, "0000:03:00.0", "amdgpu", "gpu0"),
        (1, "0000:0b:00.0", "amdgpu", "gpu1"),
    ]


def test_simpledrm_on_card0_does_not_push_the_gpu_to_gpu1() -> None:
    sysfs, _ = tree("xe")
    assert [(c.card, c.driver, c.device) for c in drm_cards(sysfs)] == [(1, "xe", "gpu0")]


def test_no_drm_class_means_no_cards(tmp_path: Path) -> None:
    assert drm_cards(tmp_path) == ()


def test_amd_sysfs_reads_each_cards_vram() -> None:
    sysfs, _ = tree("amdgpu")
    reader = AmdSysfsReader(sysfs)
    assert reader.open() is None
    reading = reader.read()
    assert reading.devices == (
        DeviceMemory("gpu0", "amdgpu 0000:03:00.0", 17163091968, 7516192768),
        DeviceMemory("gpu1", "AMD Radeon PRO W6600", 8573157376, 1342177280),
    )
    assert reading.devices[0].free_bytes == 17163091968 - 7516192768
    assert reading.measured == frozenset()  # totals only: processes come from fdinfo


def test_amd_sysfs_is_unavailable_without_vram_files() -> None:
    sysfs, _ = tree("xe")
    reason = AmdSysfsReader(sysfs).open()
    assert reason is not None
    assert "mem_info_vram_total" in reason


def test_amd_sysfs_keeps_the_cards_it_can_still_read(tmp_path: Path) -> None:
    sysfs, _ = copied_tree("amdgpu", tmp_path)
    (sysfs / "class" / "drm" / "card1" / "device" / "mem_info_vram_used").unlink()
    reading = AmdSysfsReader(sysfs).read()
    assert [d.device for d in reading.devices] == ["gpu0"]
    assert len(reading.errors) == 1
    assert reading.errors[0].startswith("gpu1: ")
    (sysfs / "class" / "drm" / "card0" / "device" / "mem_info_vram_used").unlink()
    with pytest.raises(TelemetryError, match="amd-sysfs"):
        AmdSysfsReader(sysfs).read()


# -- DRM fdinfo ------------------------------------------------------------------------------


def test_amdgpu_fdinfo_counts_a_shared_client_once_and_sums_two_clients() -> None:
    sysfs, procfs = tree("amdgpu")
    reader = DrmFdinfoReader(procfs, sysfs, name_of=name_of)
    assert reader.open() is None
    reading = reader.read()
    # 4242: client 12 (fds 5 and 6, resident 6144 MiB of a requested 7168) + client 13.
    # 5151: the older format's drm-memory-vram on the second card.
    # 6161 (GTT only) and 7171 (no DRM fd) hold no device memory: not listed.
    assert by_pid(reading) == {
        (4242, "gpu0"): 6144 * MiB + 262148 * KiB,
        (5151, "gpu1"): 1048576 * KiB,
    }
    assert {p.pid: p.name for p in reading.processes} == {4242: "python3", 5151: "Game.exe"}
    assert reading.measured == frozenset({"gpu0", "gpu1"})
    assert reading.process_bytes(6161, "gpu0") == 0


def test_i915_counts_local_memory_not_system_memory() -> None:
    sysfs, procfs = tree("i915")
    reading = DrmFdinfoReader(procfs, sysfs, name_of=name_of).read()
    # client 7 on the Arc (card1 → gpu1): resident local0; client 8 on the iGPU: system0 only.
    assert by_pid(reading) == {(3001, "gpu1"): 3072 * MiB}
    assert reading.process_bytes(3001, "gpu0") == 0


def test_xe_counts_vram0_once_per_client_and_ignores_cycle_counters() -> None:
    sysfs, procfs = tree("xe")
    reading = DrmFdinfoReader(procfs, sysfs, name_of=name_of).read()
    # client 6 on fds 4 and 5 (2052 MiB) + client 9 (512 MiB resident of 1024).
    assert by_pid(reading) == {(9001, "gpu0"): 2052 * MiB + 512 * MiB}


def test_fdinfo_is_read_when_the_fd_link_cannot_be(tmp_path: Path) -> None:
    sysfs, procfs = copied_tree("xe", tmp_path)
    shutil.rmtree(procfs / "9001" / "fd")  # e.g. the link is not ours to read
    reading = DrmFdinfoReader(procfs, sysfs, name_of=name_of).read()
    assert by_pid(reading) == {(9001, "gpu0"): 2564 * MiB}


def test_a_client_on_an_unknown_pci_device_is_skipped(tmp_path: Path) -> None:
    sysfs, procfs = copied_tree("xe", tmp_path)
    shutil.rmtree(sysfs / "class" / "drm" / "card1")  # the eGPU was unplugged
    reading = DrmFdinfoReader(procfs, sysfs, name_of=name_of).read()
    assert reading.processes == ()
    assert reading.measured == frozenset()


def test_fdinfo_is_unavailable_without_processes_or_cards(tmp_path: Path) -> None:
    sysfs, procfs = tree("xe")
    assert DrmFdinfoReader(tmp_path, sysfs).open() == f"drm-fdinfo: no processes under {tmp_path}"
    assert DrmFdinfoReader(procfs, tmp_path).open() == "drm-fdinfo: no PCI DRM card"


def test_fdinfo_reads_this_machines_proc_without_failing() -> None:
    reading = DrmFdinfoReader(name_of=name_of).read()  # no GPU here: an empty, valid reading
    assert all(p.used_bytes for p in reading.processes)
