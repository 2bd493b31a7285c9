"""Derive ``spotnb/data/gpu_throughput.csv``: each GPU's training speed, in V100s.

Prints the CSV. Measured figures come from Lambda's published PyTorch training
benchmark (github.com/lambdal/deeplearning-benchmark, ``pytorch/*-fp16.csv``); the
numbers below are copied from the commits named. GPUs Lambda did not measure get a
roofline-style estimate fitted on the measured ones. ``spotnb/data/SOURCES.md`` says
how each figure was read.
"""

from __future__ import annotations

import csv
import math
import sys

LAMBDA = "https://github.com/lambdal/deeplearning-benchmark/blob/{commit}/pytorch/{file}"
V1_FILE, V2_FILE = "pytorch-train-throughput-fp16.csv", "pytorch-train-throughput-v2-fp16.csv"
# 2024-07-24: V100 16GB, A10, A100 80GB SXM4 and H100 SXM5 rows (as at HEAD, 2025-12).
V1 = "4e11f6891ada05d1b317309d9b72c6072aa166d1"
# 2022-11-30: the last version with the A100 40GB SXM4 row (its A100 80GB row is V1's).
V1_A100_40 = "8be85ce5e162d9628503eddce326c4bc06d1e6cb"
# 2025-12-10: the v2 suite (newer container) that measured the H200 beside the H100.
V2 = "200af3b7ce8ee1f55c7ed6eaee0df2cafe2d7886"

# Samples (images, sentences, tokens...) per second, mixed precision, one GPU.
V1_WORKLOADS = ("ssd", "bert_base_squad", "bert_large_squad", "gnmt", "resnet50",
                "transformerxlbase", "transformerxllarge", "waveglow")
V1_ROWS = {  # Lambda's row name -> its workloads, in V1_WORKLOADS' order
    "LambdaCloud V100 16GB": (229, 189, 57, 79111, 833, 18493, 6071, 47253),
    "LambdaCloud A10": (174, 135, 42, 67836, 638, 16283, 5614, 80357),
    "A100 40GB SXM4": (422, 416, 133, 212958, 1455, 38957, 17558, 204712),
    "A100 80GB SXM4": (458, 443, 152, 243500, 1582, 43078, 17918, 244438),
    "H100 80GB SXM5": (782, 812, 301, 467071, 2616, 62259, 30841, 393500),
}
V2_WORKLOADS = ("ssd", "bert_base_squad", "bert_large_squad", "gnmt", "resnet50", "waveglow")
V2_ROWS = {
    "LambdaOD_1x_1xH100_80GB_SXM5_192-222-52-83_v2": (869, 915, 321, 483638, 2683, 483190),
    "LambdaBM_ENG04_1xH200_140GB_SXM_h200_v2": (946, 932, 350, 570504, 3079, 549126),
}
BASE = "LambdaCloud V100 16GB"

# Datasheet peaks: dense FP16 Tensor TFLOPS and memory bandwidth in GB/s.
SPECS = {
    "T4": (65, 320), "A10": (125, 600), "A10G": (70, 600), "L4": (121, 300),
    "L40S": (366, 864), "V100": (125, 900), "A100": (312, 1555), "A100-80GB": (312, 2039),
    "H100": (989, 3350), "H200": (989, 4800),
}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def measured() -> dict[str, float]:
    """Each measured GPU's geometric-mean speed over the workloads, V100 = 1."""
    base = V1_ROWS[BASE]

    def v1(row: str) -> float:
        return geomean([a / b for a, b in zip(V1_ROWS[row], base, strict=True)])

    h100_v2, h200_v2 = V2_ROWS.values()
    h200_over_h100 = geomean([a / b for a, b in zip(h200_v2, h100_v2, strict=True)])
    return {"V100": v1(BASE), "A10": v1("LambdaCloud A10"), "A100": v1("A100 40GB SXM4"),
            "A100-80GB": v1("A100 80GB SXM4"), "H100": v1("H100 80GB SXM5"),
            "H200": v1("H100 80GB SXM5") * h200_over_h100}


def roofline(share: float, scale: float, model: str) -> float:
    """Speed if a step spends ``share`` of a V100's step time on arithmetic at the
    tensor peak and the rest on memory traffic at the bandwidth peak."""
    tflops, bandwidth = SPECS[model]
    v_tflops, v_bandwidth = SPECS["V100"]
    return scale / (share * v_tflops / tflops + (1 - share) * v_bandwidth / bandwidth)


def fit(points: dict[str, float]) -> tuple[float, float, float]:
    """The share (to 0.01) and scale that fit the measured points best in log terms,
    and the worst ratio of fitted to measured."""
    best = None
    for step in range(101):
        share = step / 100
        logs = [math.log(points[m] / roofline(share, 1.0, m)) for m in points]
        scale = math.exp(sum(logs) / len(logs))
        err = sum((lg - math.log(scale)) ** 2 for lg in logs)
        if best is None or err < best[0]:
            best = (err, share, scale)
    assert best is not None
    _err, share, scale = best
    worst = max(abs(math.log(roofline(share, scale, m) / points[m])) for m in points)
    return share, scale, math.exp(worst)


def main() -> None:
    points = measured()
    share, scale, worst = fit(points)
    print(f"# fit: share {share:.2f}, scale {scale:.3f}, worst error x{worst:.2f}",
          file=sys.stderr)
    for m in points:
        print(f"#   {m}: measured {points[m]:.2f} fitted {roofline(share, scale, m):.2f}",
              file=sys.stderr)
    for m in ("T4", "A10G", "L4", "L40S"):
        print(f"#   {m}: derived {roofline(share, scale, m):.2f}", file=sys.stderr)
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(["gpu_model", "training_speed", "kind", "fp16_tensor_tflops",
                  "memory_bandwidth_gbs", "basis", "source"])
    v1 = LAMBDA.format(commit=V1, file=V1_FILE)
    derived = (f"derived: a roofline fit on the measured GPUs (share {share:.2f} of a "
               f"V100 step at the tensor peak, the rest at the memory bandwidth; "
               f"within x{worst:.2f} of every measured GPU)")
    rows = [
        ("T4", "derived", derived, v1),
        ("T4g", "derived", "the T4's figure: the g5g's T4G is the same GPU", v1),
        ("A10G", "derived", derived + "; Lambda measured the A10 at "
         f"{points['A10']:.2f}", v1),
        ("L4", "derived", derived, v1),
        ("L40S", "derived", derived, v1),
        ("V100", "measured", f"Lambda's '{BASE}' row, the unit", v1),
        ("V100-32GB", "measured", "the V100 16GB row: the same SXM2 GPU, more memory", v1),
        ("A100", "measured", "Lambda's 'A100 40GB SXM4' row",
         LAMBDA.format(commit=V1_A100_40, file=V1_FILE)),
        ("A100-80GB", "measured", "Lambda's 'A100 80GB SXM4' row", v1),
        ("H100", "measured", "Lambda's 'H100 80GB SXM5' row", v1),
        ("H200", "measured", "the H100's figure times H200/H100 in Lambda's v2 suite "
         "(1xH200 140GB SXM against 1xH100 80GB SXM5)", LAMBDA.format(commit=V2, file=V2_FILE)),
    ]
    for model, kind, basis, source in rows:
        spec = {"T4g": "T4", "V100-32GB": "V100"}.get(model, model)
        speed = points[spec] if spec in points else roofline(share, scale, spec)
        tflops, bandwidth = SPECS[spec]
        out.writerow([model, f"{speed:.2f}", kind, tflops, bandwidth, basis, source])


if __name__ == "__main__":
    main()
