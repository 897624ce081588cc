"""MFU's peak by part and variant: real torch.cuda.get_device_name() strings, no GPU needed."""
import pytest
import torch

from syncwise.metrics import mfu, peak_flops
from syncwise.metrics.system import PEAK_ENV, PEAK_TABLE, detect_peak, peak_for_name

NO_ENV: dict = {}

# (device name as torch reports it, part, dense bf16 TFLOP/s)
KNOWN = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM5", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA H800", "H800 SXM5", 989.4),
    ("NVIDIA H800 PCIe", "H800 PCIe", 756.5),
    ("NVIDIA H20", "H20", 148.0),
    ("NVIDIA GH200 480GB", "GH200", 989.4),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM4", 312.0),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM4", 312.0),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312.0),
    ("NVIDIA A800-SXM4-80GB", "A800", 312.0),
    ("NVIDIA A10G", "A10G", 125.0),
    ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA A30", "A30", 165.0),
    ("NVIDIA A40", "A40", 149.7),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA L40", "L40", 181.05),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165.2),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090", 71.0),
    ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA GB200", "GB200", 2500.0),
    ("Tesla V100-SXM2-16GB", "V100 SXM2", 125.0),
    ("Tesla V100-PCIE-32GB", "V100 PCIe", 112.0),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe", 130.0),
    ("Tesla T4", "T4", 65.0),
    ("AMD Instinct MI300X", "MI300X", 1307.4),
    ("AMD Instinct MI300X VF", "MI300X", 1307.4),
    ("AMD Instinct MI325X", "MI325X", 1307.4),
    ("AMD Instinct MI250X/MI250", "MI250X (one GCD)", 191.5),
    ("AMD Instinct MI210", "MI210", 181.0),
]


@pytest.mark.parametrize("name,part,tflops", KNOWN, ids=[k[0] for k in KNOWN])
def test_real_device_names_map_to_their_part_and_dense_peak(name, part, tflops):
    info = peak_for_name(name, NO_ENV)
    assert info.part == part
    assert info.flops == pytest.approx(tflops * 1e12)
    assert info.source                                     # every figure says where it comes from


def test_h100_variants_are_told_apart():
    sxm, pcie, nvl = (peak_for_name(n, NO_ENV).flops
                      for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"))
    assert sxm > nvl > pcie
    # An MFU of 40 % on an SXM part is 52 % of a PCIe part's peak for the same throughput.
    fpt, tps = 2.15e9, 0.4 * sxm / 2.15e9
    assert mfu(fpt, tps, sxm) == pytest.approx(0.40)
    assert mfu(fpt, tps, pcie) == pytest.approx(0.40 * 989.4 / 756.5)


def test_names_that_contain_another_part_do_not_match_it():
    # a10/a100, l4/l40/l40s, h20/h200, b200/gb200: each is its own part.
    parts = {n: peak_for_name(n, NO_ENV).part for n in
             ("NVIDIA A10", "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "NVIDIA L40", "NVIDIA L40S",
              "NVIDIA H20", "NVIDIA H200", "NVIDIA B200", "NVIDIA GB200")}
    assert len(set(parts.values())) == len(parts), parts


def test_mig_slice_gets_its_share_of_the_gpu():
    info = peak_for_name("NVIDIA H100 80GB HBM3 MIG 3g.40gb", NO_ENV)
    assert info.part == "H100 SXM5 MIG 3g"
    assert info.flops == pytest.approx(989.4e12 * 3 / 7)
    assert "estimate" in info.source


def test_unknown_part_and_cpu_give_none_with_a_reason():
    for name in ("NVIDIA Quantum Widget 9000", "Some New Accelerator"):
        info = peak_for_name(name, NO_ENV)
        assert info.flops is None and info.part == name and PEAK_ENV in info.source
    cpu = peak_for_name(None, NO_ENV)
    assert cpu.flops is None and cpu.part == "cpu" and PEAK_ENV in cpu.source
    assert mfu(1e9, 1e3, None) is None


def test_env_override_wins_and_a_bad_value_is_ignored_with_a_reason():
    info = peak_for_name("NVIDIA Quantum Widget 9000", {PEAK_ENV: "500"})
    assert info.flops == 500e12 and PEAK_ENV in info.source
    assert peak_for_name("NVIDIA H100 PCIe", {PEAK_ENV: " 700.5 "}).flops == 700.5e12
    assert peak_for_name(None, {PEAK_ENV: "100"}).flops == 100e12     # a CPU, when the user says so
    for bad in ("fast", "-3", "0", "inf", "nan"):
        info = peak_for_name("NVIDIA H100 PCIe", {PEAK_ENV: bad})
        assert info.flops is None and "ignored" in info.source, bad
    assert peak_for_name("NVIDIA H100 PCIe", {PEAK_ENV: ""}).flops == 756.5e12   # empty = unset


def test_detect_peak_and_peak_flops_on_this_machine(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert detect_peak(torch.device("cpu")).flops is None
    assert peak_flops(torch.device("cpu")) is None and peak_flops(None) is None
    if torch.cuda.is_available():
        dev = torch.device("cuda", 0)
        info = detect_peak(dev)
        assert info == peak_for_name(torch.cuda.get_device_name(dev), {})
        assert peak_flops(dev) == info.flops


def test_table_is_well_formed():
    for entry in PEAK_TABLE:
        assert 10 <= entry.tflops <= 5000 and entry.part and entry.source, entry
