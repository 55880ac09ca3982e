"""Datasets and samplers (minidist/core/data.py): batches are a function of (seed, step), rank slices
concatenate to the serial batch, and bad sizes fail with the numbers in the message."""
import numpy as np
import pytest

from minidist.core.data import (IGNORE_INDEX, SortTask, TextData, accuracy, decode, encode, exact_match,
                           make_task, shard_rows)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(("hello, distributed world! " * 40).encode())
    return str(path)


def tasks(text_file):
    return [make_task("sort", 64, seed=3), make_task(text_file, 32, seed=3)]


def test_batches_are_a_function_of_seed_and_step(text_file):
    for task in tasks(text_file):
        x1, y1 = task.get_batch(7, 8)
        x2, y2 = task.get_batch(7, 8)
        assert x1.dtype == y1.dtype == np.int64
        assert x1.shape == y1.shape == (8, task.block_size)
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
        assert not np.array_equal(task.get_batch(8, 8)[0], x1)  # another step, another batch
    other = make_task("sort", 64, seed=4)
    assert not np.array_equal(other.get_batch(7, 8)[0], make_task("sort", 64, seed=3).get_batch(7, 8)[0])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 12])
def test_rank_slices_concatenate_to_the_serial_batch(text_file, world_size):
    for task in tasks(text_file):
        x, y = task.get_batch(5, 12)
        parts = [task.get_batch(5, 12, rank=r, world_size=world_size) for r in range(world_size)]
        assert all(px.shape == (12 // world_size, task.block_size) for px, _ in parts)
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)


def test_shard_rows_errors_name_the_numbers():
    assert shard_rows(12, 2, 4) == slice(6, 9)
    with pytest.raises(ValueError, match=r"global batch 10 is not divisible by world size 4"):
        shard_rows(10, 0, 4)
    with pytest.raises(ValueError, match=r"rank 4 is outside 0..3"):
        shard_rows(8, 4, 4)


def test_sort_rows_and_targets():
    task = SortTask(block_size=20, seed=0, length=4)
    x, y = task.get_batch(0, 16)
    for row_x, row_y in zip(x, y):
        text = decode(row_x)
        digits, answer = text[:4], text[5:9]
        assert text[4] == "=" and answer == "".join(sorted(digits)) and text[9:] == " " * 11
        counted = row_y != IGNORE_INDEX
        assert counted.sum() == 4 and list(np.flatnonzero(counted)) == [4, 5, 6, 7]
        assert decode(row_y[counted]) == answer  # y[t] is the byte after x[t]
    prompt, expected = task.sample_prompt(3)
    assert decode(prompt)[-1] == "=" and expected == "".join(sorted(decode(prompt)[:-1]))
    assert task.format_sample(prompt, encode(expected), expected) == f"{decode(prompt)[:-1]} -> {expected} (expected {expected})"


def test_sort_task_too_long_for_block():
    SortTask(block_size=16, length=8)  # 8 digits, "=", 8 digits: 17 bytes = block_size + 1
    with pytest.raises(ValueError, match=r"needs rows of 17 bytes, so block_size >= 16; got block_size 15"):
        SortTask(block_size=15, length=8)
    with pytest.raises(ValueError, match="bad task"):
        make_task("sort:x", 64)
    assert make_task("sort:5:3", 64).length == 5 and make_task("sort:5:3", 64).num_digits == 3


def test_text_windows_are_shifted_by_one(text_file):
    task = TextData(text_file, 32, seed=0)
    data = open(text_file, "rb").read()
    x, y = task.get_batch(0, 6)
    for row_x, row_y in zip(x, y):
        start = data.find(bytes(row_x.astype(np.uint8).tolist()))
        assert start >= 0
        np.testing.assert_array_equal(row_y, np.frombuffer(data[start + 1:start + 33], np.uint8))
    prompt, expected = task.sample_prompt(1)
    assert (decode(prompt) + expected) in data.decode()


def test_text_file_shorter_than_a_window(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 64)
    TextData(str(path), 63)
    with pytest.raises(ValueError, match=r"has 64 bytes, fewer than block_size \+ 1 = 65"):
        TextData(str(path), 64)
    with pytest.raises(FileNotFoundError, match="no task or file named"):
        make_task(str(tmp_path / "missing.txt"), 8)


def test_accuracy_and_exact_match():
    targets = np.array([[IGNORE_INDEX, 1, 2], [IGNORE_INDEX, 0, IGNORE_INDEX]])
    logits = np.zeros((2, 3, 4))
    logits[0, 1, 1] = logits[0, 2, 3] = logits[1, 1, 0] = 1.0  # row 0: 1 of 2 right; row 1: right
    logits[0, 0, 2] = 1.0  # an ignored position may be anything
    assert accuracy(logits, targets) == pytest.approx(2 / 3)
    assert exact_match(logits, targets) == pytest.approx(1 / 2)


def test_encode_decode_round_trip():
    assert decode(encode("sort 3142=1234, 分布式")) == "sort 3142=1234, 分布式"
    assert encode("AB").tolist() == [65, 66]
