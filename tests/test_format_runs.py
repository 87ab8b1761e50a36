"""Chapter 07's measurements: each format's kernel timed, and the engine's decode rate beside its bytes."""

import pytest

from minserve.capacity.format_kernels import time_kernels
from minserve.capacity.format_runs import format_speed_table, storage_options


def test_every_formats_kernel_is_timed_at_every_batch():
    table = time_kernels({"tiny": (64, 128)}, batches=(1, 4), repeats=2, sides=["fp32", "int8", "int4-g32", "fp8"])
    assert list(table["batch"]) == [1, 4] and set(table.columns) >= {"fp32", "int8", "int4-g32", "fp8"}
    assert (table[["fp32", "int8", "int4-g32", "fp8"]] > 0).all().all()


def test_the_speed_table_reads_fewer_bytes_per_step_for_narrower_formats():
    speed = format_speed_table("minserve-tiny", ["fp32", "int8"], bandwidth_bytes_per_s=10e9, tokens=4, repeats=1)
    assert speed.loc["fp32", "bits/weight"] == 32 and speed.loc["int8", "bits/weight"] == pytest.approx(8, abs=0.2)
    assert speed.loc["int8", "read per step (MB)"] < speed.loc["fp32", "read per step (MB)"] / 3
    roofline = 10e9 / (speed["read per step (MB)"] * 1e6)
    assert speed["roofline tokens/s"].tolist() == pytest.approx(roofline.tolist())
    assert (speed["tokens/s"] > 0).all()


def test_storage_labels_name_dtypes_and_formats():
    assert storage_options("bf16") == {"dtype": "bfloat16"}
    assert storage_options("int4-g32+kv-int8") == {
        "dtype": "float32", "quantization": "int4", "quant_group_size": 32, "kv_cache_dtype": "int8",
    }  # fmt: skip
