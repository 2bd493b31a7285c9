"""The bundled catalog: instance types, pools, advisor data and price traces."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from spotnb.protocol.spec import SpecError
from spotnb.providers import catalog


def test_instance_types_describe_the_hardware() -> None:
    types = catalog.instance_types()
    g5 = types["g5.xlarge"]
    assert (g5.family, g5.gpu_model, g5.gpu_count, g5.gpu_manufacturer) == (
        "g5", "A10G", 1, "NVIDIA")
    assert g5.gpu_memory_mib and g5.gpu_memory_mib > 20000
    assert (g5.vcpus, g5.memory_gib) == (4, 16.0)
    assert types["p3.8xlarge"].gpu_count == 4
    # Inferentia has no GPU memory figure in the source: unknown, not zero.
    assert types["inf2.xlarge"].gpu_memory_mib is None
    # The catalog is GPU-only.
    assert "m5.large" not in types


def test_gpu_speeds_are_training_throughput_measured_or_derived_from_bandwidth() -> None:
    speeds = catalog.gpu_speeds()
    nvidia = {t.gpu_model for t in catalog.instance_types().values()
              if t.gpu_manufacturer == "NVIDIA"}
    assert nvidia <= set(speeds)
    assert speeds["V100"].training == 1.0  # the unit
    measured = {m for m, s in speeds.items() if s.measured}
    assert {"V100", "A100", "A100-80GB", "H100", "H200"} <= measured
    assert not measured & {"T4", "L4", "L40S", "A10G"}  # no benchmark published: derived
    assert all(s.source.startswith("https://") and s.basis for s in speeds.values())
    # Memory bandwidth counts: the same tensor peak, more bandwidth, faster.
    assert speeds["H200"].tflops == speeds["H100"].tflops
    assert speeds["H200"].training > speeds["H100"].training
    assert speeds["A10G"].training > speeds["L4"].training  # 600 against 300 GB/s


def test_gpu_throughput_csv_is_what_its_derivation_script_prints() -> None:
    root = Path(__file__).resolve().parents[1]
    printed = subprocess.run([sys.executable, str(root / "scripts/gpu_training_speed.py")],
                             check=True, capture_output=True, text=True).stdout
    assert printed == (root / "spotnb/data/gpu_throughput.csv").read_text()
    sources = (root / "spotnb/data/SOURCES.md").read_text()
    for model in catalog.gpu_speeds():
        assert f"| {model} |" in sources  # each figure's row in the provenance table


def test_pools_are_spot_pools_cheapest_first_and_below_on_demand() -> None:
    found = catalog.pools("p3.2xlarge", "us-east-1")
    # The catalog lists six us-east-1 AZs for p3.2xlarge; two have no spot price.
    assert [p.az for p in found] == ["use1-az1", "use1-az2", "use1-az5", "use1-az6"]
    spots = [p.spot for p in found]
    assert all(s is not None for s in spots)
    assert spots == sorted(spots)  # type: ignore[type-var]
    assert all(p.ondemand == 3.06 for p in found)
    assert found[0].name == "p3.2xlarge@use1-az1"
    assert catalog.ondemand_price("p3.2xlarge", "us-east-1") == 3.06
    assert catalog.ondemand_price("p3.2xlarge", "af-south-1") is None
    assert catalog.pools("p5.48xlarge", "af-south-1") == []


def test_regions_lists_where_a_type_has_spot_pools() -> None:
    where = catalog.regions("p5.48xlarge")
    assert "us-east-1" in where and "af-south-1" not in where
    assert where == sorted(where)
    assert "us-east-1" in catalog.all_regions()


def test_interruption_bucket_and_savings_from_the_advisor() -> None:
    bucket = catalog.interruption_bucket("g4ad.xlarge", "us-east-1")
    assert bucket is not None
    assert (bucket.index, bucket.label, bucket.max_pct) == (0, "<5%", 5.0)
    high = catalog.interruption_bucket("p3.2xlarge", "us-east-1")
    assert high is not None and high.label == ">20%" and high.max_pct == 100.0
    assert catalog.savings_pct("p3.2xlarge", "us-east-1") is not None
    assert catalog.interruption_bucket("g5.xlarge", "mars-north-1") is None
    assert catalog.DATA_DATE["advisor"] == "2025-06-28"
    assert "2024-12" in catalog.DATA_DATE["catalog"]


def test_price_trace_uses_real_history_where_the_type_has_it() -> None:
    trace = catalog.price_trace("p3.2xlarge", "us-east-1", "use1-az1")
    assert not trace.scaled
    assert "real spot price history of p3.2xlarge in us-east-1" in trace.source
    assert len(trace.points) > 300
    times = [t for t, _ in trace.points]
    assert times == sorted(times)
    # Real 2019-20 prices of p3.2xlarge in us-east-1 were about $0.92-1.23 per hour.
    assert 0.9 < min(p for _, p in trace.points) < max(p for _, p in trace.points) < 1.3


def test_price_trace_of_2022_history_keyed_by_az_id() -> None:
    trace = catalog.price_trace("g5.48xlarge", "us-east-1", "use1-az1")
    assert not trace.scaled
    assert "in use1-az1" in trace.source and "2022-05-31" in trace.source
    assert len(trace.points) == 2


def test_price_trace_without_history_is_a_scaled_related_shape() -> None:
    pool = catalog.pools("g4dn.xlarge", "us-east-1")[0]
    trace = catalog.price_trace("g4dn.xlarge", "us-east-1", pool.az)
    assert trace.scaled
    assert "scaled to this pool's catalog spot price" in trace.source
    assert "p3.2xlarge" in trace.source  # no T4 history: the fallback shape
    # The scaling is documented: the trace's median is the catalog price.
    assert statistics.median(p for _, p in trace.points) == pytest.approx(pool.spot, rel=1e-3)
    # p3 in a region without history borrows the shape of its own family.
    tokyo = catalog.price_trace("p3.2xlarge", "ap-northeast-1",
                                catalog.pools("p3.2xlarge", "ap-northeast-1")[0].az)
    assert tokyo.scaled and "real p3." in tokyo.source


def test_no_trace_price_exceeds_on_demand() -> None:
    for name in catalog.instance_types():
        for region in catalog.regions(name):
            for pool in catalog.pools(name, region):
                trace = catalog.price_trace(name, region, pool.az)
                assert trace.points
                if pool.ondemand is not None:
                    assert max(p for _, p in trace.points) <= pool.ondemand, trace.source


def test_check_instance_type_suggests_close_names() -> None:
    assert catalog.check_instance_type("g5.xlarge").name == "g5.xlarge"
    with pytest.raises(SpecError, match=r"did you mean 'g5\.xlarge'") as err:
        catalog.check_instance_type("g5.xlarg")
    assert "spotnb catalog" in str(err.value) and "%spot_picker" in str(err.value)
    with pytest.raises(SpecError, match="GPU and accelerator instance types only"):
        catalog.check_instance_type("m5.large")


def test_check_instance_type_names_regions_that_have_it() -> None:
    with pytest.raises(SpecError, match="no spot pool in af-south-1") as err:
        catalog.check_instance_type("p5.48xlarge", "af-south-1")
    assert "us-east-1" in str(err.value)
    with pytest.raises(SpecError, match=r"unknown AWS region 'us-east-7'.*'us-east-1'"):
        catalog.check_instance_type("g5.xlarge", "us-east-7")
