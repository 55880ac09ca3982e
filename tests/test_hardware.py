"""Hardware as data (chapter 9): the presets, the JSON format, and measuring this machine."""
from __future__ import annotations

import json

import pytest

from minidist.plan.hardware import (PRECISIONS, PRESETS, Device, device_table, load_device, measure_this_machine,
                                    to_json)

A100, A100_80, H100, V100 = (PRESETS[k] for k in ("a100-40gb", "a100-80gb", "h100-80gb-sxm", "v100-32gb"))


def test_preset_names():
    assert set(PRESETS) == {"a100-40gb", "a100-80gb", "h100-80gb-sxm", "v100-32gb"}


@pytest.mark.parametrize("device", [A100, A100_80, H100])
def test_tensor_cores_beat_plain_fp32(device):
    assert device.flops("bf16") > device.flops("tf32") > device.flops("fp32")
    assert device.flops("mixed") == device.flops("bf16")


@pytest.mark.parametrize("older", [A100, A100_80, V100])
def test_h100_beats_older_devices(older):
    for p in ("fp64", "fp32", "tf32", "mixed"):
        assert H100.flops(p) > older.flops(p), p
    assert H100.memory_bandwidth > older.memory_bandwidth
    assert H100.intra_bandwidth > older.intra_bandwidth
    assert H100.inter_bandwidth > older.inter_bandwidth
    assert H100.memory >= older.memory


def test_sizes_and_links():
    assert A100_80.memory == H100.memory == 80e9 and A100.memory == 40e9 and V100.memory == 32e9
    assert A100_80.memory_bandwidth > A100.memory_bandwidth and A100.flops("bf16") == A100_80.flops("bf16")
    for d in PRESETS.values():
        assert d.intra_bandwidth > d.inter_bandwidth and d.intra_latency < d.inter_latency
        assert d.gpus_per_node == 8 and d.source


def test_v100_precisions():
    assert V100.flops("mixed") == V100.flops("fp16") == 125e12
    assert V100.flops("tf32") == V100.flops("fp32")  # no TF32 units before Ampere
    with pytest.raises(ValueError, match="no bf16"):
        V100.flops("bf16")


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError) as e:
        A100.flops("int8")
    assert "\n" not in str(e.value) and all(p in str(e.value) for p in (*PRECISIONS, "mixed"))


def test_device_is_frozen_and_hashable():
    assert hash(A100) == hash(Device(**{**to_json(A100)}))
    with pytest.raises(AttributeError):
        A100.memory = 1.0


@pytest.mark.parametrize("name", list(PRESETS))
def test_load_preset(name):
    assert load_device(name) is PRESETS[name]


@pytest.mark.parametrize("name", list(PRESETS))
def test_json_round_trip(tmp_path, name):
    path = tmp_path / "device.json"
    path.write_text(json.dumps(to_json(PRESETS[name])))
    assert load_device(str(path)) == PRESETS[name]


def _one_line_error(spec: str, *words: str) -> str:
    with pytest.raises(ValueError) as e:
        load_device(spec)
    message = str(e.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_unknown_preset_lists_the_choices():
    _one_line_error("b200", "b200", *PRESETS, "this-machine", "JSON")


def test_missing_file(tmp_path):
    _one_line_error(str(tmp_path / "nowhere.json"), "nowhere.json", "not found")


def test_invalid_json_names_the_file(tmp_path):
    message = _one_line_error(_write(tmp_path, '{"name": "x",'), "bad.json", "not valid JSON")
    assert "char" not in message  # no decoder internals


def test_not_an_object(tmp_path):
    _one_line_error(_write(tmp_path, [1, 2]), "bad.json", "object")


def test_missing_fields(tmp_path):
    data = to_json(A100)
    del data["memory"], data["inter_latency"]
    _one_line_error(_write(tmp_path, data), "bad.json", "missing", "memory", "inter_latency")


def test_unknown_fields(tmp_path):
    _one_line_error(_write(tmp_path, {**to_json(A100), "tdp": 400}), "bad.json", "unknown", "tdp")


@pytest.mark.parametrize("field, value", [("memory", 0), ("intra_bandwidth", -1.0), ("inter_latency", "fast"),
                                          ("gpus_per_node", 8.5), ("gpus_per_node", True)])
def test_non_positive_fields(tmp_path, field, value):
    _one_line_error(_write(tmp_path, {**to_json(A100), field: value}), "bad.json", field)


@pytest.mark.parametrize("peak_flops, words", [({"fp32": 0}, ["peak_flops.fp32"]),
                                               ({"fp64": 1e12}, ["fp32"]),
                                               ({"fp32": 1e12, "fp8": 2e12}, ["unknown precisions", "fp8"]),
                                               ([1e12], ["peak_flops", "object"])])
def test_bad_peak_flops(tmp_path, peak_flops, words):
    _one_line_error(_write(tmp_path, {**to_json(A100), "peak_flops": peak_flops}), "bad.json", *words)


def test_source_is_optional_in_json(tmp_path):
    data = to_json(V100)
    del data["source"]
    device = load_device(_write(tmp_path, data))
    assert "bad.json" in device.source and device.flops("mixed") == 125e12


def test_measure_this_machine():
    d = measure_this_machine(seconds=0.05)
    for p in (*PRECISIONS, "mixed"):
        assert d.flops(p) > 0
    assert d.flops("bf16") == d.flops("fp32")  # NumPy has no 16-bit matrix units
    assert d.memory > 0 and d.memory_bandwidth > 0 and d.gpus_per_node >= 1
    assert d.intra_bandwidth == d.inter_bandwidth == d.memory_bandwidth / 2
    assert d.source.startswith("measured on this machine (numpy ")
    assert Device(**to_json(d)) == d


def test_device_table():
    table = device_table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(PRESETS) and all(name in table for name in PRESETS)
    assert len({len(line) for line in lines[:-1]}) == 1  # aligned columns
    assert "989.5" in table and "6.25" in table


def test_this_machine_carries_its_gemm_curve():
    """this-machine's GEMM curve is fitted to its matmuls (small GEMMs cost what a CPU makes them
    cost, not a GPU's 4 GFLOP half-way point), and a cluster of it uses that curve."""
    from minidist.plan.workload import Cluster, GemmCurve
    d = measure_this_machine(seconds=0.05)
    e, half = d.gemm_curve
    assert 0 < e <= 1 and 0 <= half < 1e9
    assert Cluster.of(d, 4, "fp32").gemm == GemmCurve(e, half)
    assert Cluster.of(PRESETS["a100-80gb"], 4).gemm == GemmCurve()  # presets: the planner's default


def test_the_gemm_line_is_fitted_back():
    from minidist.plan.hardware import fit_gemm_line
    points = [(w, (w + 2e5) / (0.8 * 1e11)) for w in (1e4, 1e5, 1e6, 1e7)]
    assert fit_gemm_line(points, 1e11) == pytest.approx((0.8, 2e5))


@pytest.mark.parametrize("curve", [[0, 1e5], [1.5, 1e5], [0.5], "fast", [2.0, 0]])
def test_bad_gemm_curve(tmp_path, curve):
    _one_line_error(_write(tmp_path, {**to_json(A100), "gemm_curve": curve}), "bad.json", "gemm_curve")
