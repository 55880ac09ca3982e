"""What holds when things go wrong (chapter 2, the README's Reliability section): every failure
ends in one line with exit status 2, on every rank, within its timeout, and leaves nothing behind.

Unit tests (quick tier): 16-bit and 8-bit float arrays round-trip through a checkpoint part;
an edited manifest is refused naming the field; ranks agree on a failure one of them saw; a
write that fills the disk leaves no temporary; the least memory of a run, to the byte; the
command lines' bounds. Under real mpiexec (full tier): a bf16 run resumes bit for bit; a part
that cannot be read, or an edited manifest, stops both ranks in one line; a full disk during a
checkpoint or --save; a killed or terminated job leaves no shared memory nor launcher file; and
--balance with dropout equals the serial run whatever the split.
"""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from minidist.comm.launch import find_mpiexec
from minidist.training import checkpoint

from test_checkpoint import demo  # the demo under mpiexec (timeout 120 s), with MINIDIST_KILL

SMALL = ["--steps", "8", "--dropout", "0.1", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
         "--batch-size", "8", "--log-every", "-1"]
PROGRESS = re.compile(r"[\w-]+:\s+\d+%\|[^\r\n]*?\]")  # a redraw of the progress bar (tqdm, on stderr)


def messages(stderr: str) -> list[str]:
    """stderr's lines without the progress bar's redraws (a message may follow one directly)."""
    return [line for line in re.split(r"[\r\n]", PROGRESS.sub("", stderr)) if line.strip()]


def one_line(proc) -> str:
    """The single line a failed run printed; exit status 2 (faults.fail), no traceback."""
    lines = messages(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


# ----------------------------------------------------------------------------- checkpoint files (unit)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_16_and_8_bit_floats_round_trip_through_a_part(tmp_path, dtype):
    """ml_dtypes' formats are stored as their bits, whatever `kind` they claim (float8_e5m2 says
    'f', bfloat16 'V'), and come back exactly in the manifest's dtype."""
    array = np.array([[0.5, -1.75, 3.0], [448.0, 2.0**-6, 0.0]], dtype=np.float32).astype(getattr(ml_dtypes, dtype))
    _, arrays = checkpoint.plan([{"w": {"shape": [2, 3], "dtype": array.dtype.name}}], 1)
    part = checkpoint.write_part(tmp_path, 0, 1, {"w": array})
    assert part["arrays"]["w"] == [[2, 3], np.dtype(f"u{array.dtype.itemsize}").str]  # the bits
    manifest = {"format": checkpoint.FORMAT, "step": 1, "run": {}, "parts": [part], "arrays": arrays}
    back = checkpoint.Checkpoint(tmp_path, manifest)("w")
    assert back.dtype == array.dtype and back.tobytes() == array.tobytes()


@pytest.fixture
def committed(tmp_path):
    """A one-rank checkpoint of step 4 (two arrays), committed as a job commits it."""
    state = {"param.w": np.arange(6.0).reshape(2, 3), "step": np.array(4)}
    places = [{name: {"shape": list(a.shape), "dtype": a.dtype.name} for name, a in state.items()}]
    _, arrays = checkpoint.plan(places, 1)
    staging = checkpoint.begin(tmp_path, 4)
    part = checkpoint.write_part(staging, 0, 1, state)
    return checkpoint.commit(tmp_path, staging, 4, {"steps": 8}, [part], arrays)


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["parts"][0].pop("sha256"), "field parts[0].sha256: missing"),
    (lambda m: m["parts"][0].pop("bytes"), "field parts[0].bytes: missing"),
    (lambda m: m.update(parts=None), "field parts: expected a list of file entries, got null"),
    (lambda m: m["parts"][0].update(arrays=None), "field parts[0].arrays: expected {name: [shape, dtype]}, got null"),
    (lambda m: m["parts"][0].update(file="../../etc/passwd"), "field parts[0].file: expected a part name"),
    (lambda m: m["parts"][0].update(bytes="12"), 'field parts[0].bytes: expected a whole number >= 0, got "12"'),
    (lambda m: m.update(step=-1), "field step: expected a whole number >= 0, got -1"),
    (lambda m: m["arrays"]["step"].pop("shape"), "array step: malformed entry (field shape missing)"),
])
def test_an_edited_manifest_is_refused_naming_the_field(committed, edit, words):
    manifest = json.loads((committed / "manifest.json").read_text())
    edit(manifest)
    (committed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as error:
        checkpoint.read_manifest(committed)
    assert str(error.value).startswith(f"{committed / 'manifest.json'}: ") and words in str(error.value)


def test_a_checkpoint_of_the_last_step_or_later_is_refused(committed):
    """A run saves only steps it goes on from: step 8 of 8 steps is an edit (the demo had
    nothing left to train and crashed on its empty losses)."""
    manifest = json.loads((committed / "manifest.json").read_text())
    manifest["step"] = 8
    moved = committed.parent / checkpoint.step_name(8)
    committed.rename(moved)
    (moved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"field step: 8 is not below the run's 8 steps$"):
        checkpoint.check_run(checkpoint.read_manifest(moved), {"steps": 8}, moved)


def test_an_unreadable_part_is_refused_by_name(committed):
    part = committed / checkpoint.part_name(0, 1)
    part.unlink()
    part.mkdir()
    read = checkpoint.Checkpoint(committed, checkpoint.read_manifest(committed))
    with pytest.raises(ValueError, match=re.escape(f"{part}: cannot be read (Is a directory)")):
        read.verify([part.name])


class Group:
    """A stand-in for a 2-rank group: `allgather` returns what each rank would contribute."""

    def __init__(self, rank, others):
        self.rank, self.size, self.others = rank, 1 + len(others), others
        self.comm = self

    def allgather(self, mine):
        values = list(self.others)
        values.insert(self.rank, mine)
        return values


def test_ranks_agree_on_an_error_one_of_them_saw():
    """checkpointing.agreed: every rank raises the same ValueError; where only some ranks
    failed, it names the first; an OSError becomes 'FILE: reason'."""
    from minidist.parallel.checkpointing import agreed

    def unreadable():
        raise IsADirectoryError(errno.EISDIR, "Is a directory", "ck/step-000006/rank-00001-of-00002.npz")

    with pytest.raises(ValueError) as seen_here:
        agreed(unreadable, Group(1, [None]))
    with pytest.raises(ValueError) as seen_there:
        agreed(lambda: None, Group(0, [str(seen_here.value).removesuffix(" (on rank 1)")]))
    assert str(seen_here.value) == str(seen_there.value) == \
        "ck/step-000006/rank-00001-of-00002.npz: Is a directory (on rank 1)"
    missing = "nowhere/manifest.json: missing (a committed checkpoint always has one)"
    with pytest.raises(ValueError) as everyone:  # the same error on every rank: no rank named
        agreed(lambda: checkpoint.read_manifest("nowhere"), Group(0, [missing]))
    assert str(everyone.value) == missing
    assert agreed(lambda: None, Group(0, [None])) is None


def test_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    """The full disk shows when the buffered bytes reach it (flush, close, fsync): outside the
    write itself, yet the temporary goes and the old file stays."""
    target = tmp_path / "w.npz"
    target.write_bytes(b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left on device"):
        checkpoint.save_weights(str(target), {"w": np.ones(1000)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.npz"] and target.read_bytes() == b"old"


# ----------------------------------------------------------------------------- command lines (unit)


def test_the_least_memory_of_a_run_to_the_byte():
    """The demo's defaults (4 layers of width 128, 64 tokens, batch 16, float32): 834,304
    parameters x 16 bytes, 2 x 16 x 64 int64 tokens, one sequence's activations in one block
    (25sh + 2s + as^2 elements)."""
    from minidist.demo_flags import build_parser, check_args, least_memory

    args = build_parser().parse_args([])
    config, _, _ = check_args(args, 1)
    need, piles = least_memory(args, config, 1)
    assert need == 834_304 * 16 + 2 * 16 * 64 * 8 + (25 * 64 * 128 + 2 * 64 + 4 * 64 * 64) * 4 == 14_250_496
    assert piles == "13.3 MB for the weights, gradients and AdamW moments of 8.34e+05 parameters, 16.4 KB of " \
                    "tokens, 885 KB of activations"


def refused(main, argv, capsys) -> str:
    """A command line's main refusing `argv`: exit status 2 and one line on stderr."""
    with pytest.raises(SystemExit) as end:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert end.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_a_mesh_too_large_to_print_is_refused(capsys):
    from minidist.parallel.mesh import main

    assert refused(main, ["--dp", "100000", "--tp", "100000"], capsys) == (
        "minidist.parallel.mesh: error: --dp 100000 --tp 100000 --pp 1: a mesh of 10000000000 ranks; the table "
        "prints one line per rank, for at most 1024 ranks (see --help)")


def test_a_binary_arguments_file_is_named(tmp_path, capsys):
    from minidist.frameworks.__main__ import main

    binary = tmp_path / "args.bin"
    binary.write_bytes(b"\xff\xfe\x00--tensor-model-parallel-size 2")
    assert refused(main, ["megatron", "--world", "2", "--file", str(binary)], capsys) == (
        f"minidist.frameworks: error: --file {binary}: not a text file (Megatron-LM's arguments are UTF-8 text) "
        "(see --help)")


def test_a_student_copy_into_a_place_that_cannot_be_written(capsys):
    from minidist.assignments.__main__ import main

    assert refused(main, ["build", "/proc/minidist-student"], capsys) == (
        "minidist.assignments: error: argument out: cannot write /proc/minidist-student (No such file or "
        "directory) (see --help)")


@pytest.mark.full
def test_the_planner_answers_a_trillion_gpus_at_once(capsys):
    from minidist.plan.search import main  # python -m minidist.plan

    started = time.perf_counter()
    assert "no valid layout of 1000000000000 devices" in refused(main, ["--gpus", "1000000000000"], capsys)
    assert time.perf_counter() - started < 20


# ----------------------------------------------------------------------------- under mpiexec (full tier)


BF16 = SMALL + ["--dtype", "float32", "--dp", "2", "--precision", "bf16"]


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """bf16 dp2: straight; killed before step 5 (after the checkpoint of step 4); resumed."""
    tmp = tmp_path_factory.mktemp("bf16")
    straight = demo(2, *BF16, "--save", str(tmp / "straight.npz"), "--json", str(tmp / "straight.json"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    command = BF16 + ["--checkpoint", str(tmp / "ck"), "--checkpoint-every", "2"]
    killed = demo(2, *command, kill="1:5")
    assert killed.returncode != 0 and (tmp / "ck" / "step-000004").is_dir()
    shutil.copytree(tmp / "ck", tmp / "saved")  # for the damaged copies below
    resumed = demo(2, *command, "--save", str(tmp / "resumed.npz"), "--json", str(tmp / "resumed.json"))
    return tmp, resumed


@pytest.mark.full
def test_a_bf16_run_resumes_bit_for_bit(bf16_runs):
    tmp, resumed = bf16_runs
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp / 'ck'}: step 4 of 8" in resumed.stdout
    want, got = (json.loads((tmp / f"{tag}.json").read_text()) for tag in ("straight", "resumed"))
    assert got["first_step"] == 4 and got["losses"] == want["losses"][4:]
    want, got = (dict(np.load(tmp / f"{tag}.npz")) for tag in ("straight", "resumed"))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def damaged(bf16_runs, tmp_path, damage):
    """Resume a damaged copy of the bf16 checkpoint of step 4."""
    tmp, _ = bf16_runs
    shutil.copytree(tmp / "saved", tmp_path / "ck")
    damage(tmp_path / "ck" / "step-000004")
    return demo(2, *BF16, "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "2")


@pytest.mark.full
def test_a_part_one_rank_cannot_read_stops_both_ranks_in_one_line(bf16_runs, tmp_path):
    """Rank 1 reads rank 1's part, finds a directory, and tells rank 0 (which waited for it,
    forever, when rank 1 gave up alone)."""
    def directory(step):
        part = step / checkpoint.part_name(1, 2)
        part.unlink()
        part.mkdir()

    assert one_line(damaged(bf16_runs, tmp_path, directory)) == (
        f"error: --checkpoint {tmp_path / 'ck'}: {tmp_path / 'ck' / 'step-000004' / checkpoint.part_name(1, 2)}: "
        "cannot be read (Is a directory) (on rank 1)")


@pytest.mark.full
def test_an_edited_manifest_stops_the_demo_in_one_line(bf16_runs, tmp_path):
    def no_parts(step):
        manifest = json.loads((step / "manifest.json").read_text())
        (step / "manifest.json").write_text(json.dumps({**manifest, "parts": None}))

    assert one_line(damaged(bf16_runs, tmp_path, no_parts)) == (
        f"error: --checkpoint {tmp_path / 'ck'}: {tmp_path / 'ck' / 'step-000004' / 'manifest.json'}: field parts: "
        "expected a list of file entries, got null")


@pytest.fixture
def small_disk(tmp_path):
    """mount(size): a tmpfs of that size (root only; elsewhere the unit test above covers a full disk)."""
    mounted = []

    def mount(size: str) -> Path:
        place = tmp_path / f"disk-{size}"
        place.mkdir()
        if not shutil.which("mount") or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                                         str(place)], capture_output=True).returncode:
            pytest.skip("cannot mount a small tmpfs here (needs root)")
        mounted.append(place)
        return place

    yield mount
    for place in mounted:
        subprocess.run(["umount", str(place)], capture_output=True)


@pytest.mark.full
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(small_disk):
    """700 KB holds one checkpoint of this run (about 480 KB), not two: the save of step 4 fails
    on rank 0, whose part is the big one, and step 2 stays, whole and valid."""
    disk = small_disk("700k")
    flags = SMALL + ["--dp", "2", "--checkpoint", str(disk / "ck"), "--checkpoint-every", "2"]
    line = one_line(demo(2, *flags))
    assert line == (f"error: --checkpoint {disk / 'ck'}: the checkpoint of step 4 was not saved ({disk / 'ck'}/"
                    f"step-000004.partial/{checkpoint.part_name(0, 2)}: No space left on device (on rank 0)); "
                    f"{disk / 'ck' / 'step-000002'} is still the newest checkpoint")
    assert [p.name for p in (disk / "ck").iterdir()] == ["step-000002"]
    assert set(checkpoint.consolidate(disk / "ck" / "step-000002")) >= {"param.wte.weight", "step"}


@pytest.mark.full
def test_a_full_disk_at_save_leaves_no_temporary(small_disk):
    disk = small_disk("64k")  # the weights take 146 KB
    proc = demo(1, *SMALL, "--save", str(disk / "w.npz"))
    assert one_line(proc) == f"error: --save {disk / 'w.npz'}: cannot be written (No space left on device)"
    assert list(disk.iterdir()) == []


def job_files(pid: int) -> set[str]:
    """The MPICH shared-memory files mapped by the processes under `pid` (mpiexec), and the
    topology files their launcher holds open: what this job would leave behind."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    found, todo = set(), [pid]
    while todo:
        process = todo.pop()
        todo += children.get(process, [])
        try:
            found |= set(re.findall(r"/dev/shm/mpich_shm_\S+", Path(f"/proc/{process}/maps").read_text()))
            found |= {target for fd in Path(f"/proc/{process}/fd").iterdir()
                      if "hydra_hwloc_xmlfile_" in (target := os.readlink(fd))}
        except OSError:
            continue
    return {f for f in found if not f.endswith("(deleted)")}


def watched(command: list[str], env: dict, stop=None) -> tuple[int, set[str]]:
    """Run a job, noting its files until it ends (every 50 ms); `stop(proc)` once the demo runs."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    seen = set()
    try:
        assert proc.stdout.readline().startswith("minidist: 2 ranks")  # printed after faults.install
        started = time.monotonic()
        while proc.poll() is None and time.monotonic() - started < 60:
            seen |= job_files(proc.pid)
            if stop and time.monotonic() - started > 1:
                stop(proc)
                stop = None
            time.sleep(0.05)
        return proc.wait(timeout=30), seen
    finally:
        proc.kill()


TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
        "--log-every", "-1", "--dp", "2"]


@pytest.mark.full
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
@pytest.mark.parametrize("how", ["MINIDIST_KILL", "SIGTERM to mpiexec"])
def test_a_killed_job_leaves_no_shared_memory_nor_launcher_file(tmp_path, how):
    """MINIDIST_KILL's SIGKILL, or mpirun terminated: the ranks remove their MPICH segments
    (4 MB each) and the hydra proxy's topology file first (faults.remove_job_files)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("MINIDIST_KILL", None)
    steps = ["--steps", "100000"]
    if how == "MINIDIST_KILL":
        env["MINIDIST_KILL"] = "1:60"
        steps += ["--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "50"]
    command = [find_mpiexec(), "-n", "2", sys.executable, "-m", "minidist.demo", *steps, *TINY]
    status, seen = watched(command, env, None if how == "MINIDIST_KILL" else lambda p: p.send_signal(signal.SIGTERM))
    assert status != 0
    assert any("/dev/shm/" in f for f in seen) and any("hydra_hwloc_xmlfile_" in f for f in seen), seen
    assert [f for f in seen if os.path.exists(f)] == []


@pytest.mark.full
def test_balanced_runs_with_dropout_equal_serial_whatever_the_split(tmp_path):
    """The masks follow the rows (core/fused.py dropout_rows): two balanced runs, whose splits
    follow timing (one in two micro-batches per rank), both equal the serial run to rounding,
    and so each other (they differed far beyond rounding when each rank drew its own rows' masks)."""
    flags = SMALL + ["--dtype", "float64"]
    assert demo(1, *flags, "--save", str(tmp_path / "serial.npz")).returncode == 0
    serial = dict(np.load(tmp_path / "serial.npz"))
    for tag, extra in (("balanced", []), ("accumulating", ["--accumulation", "2"])):
        proc = demo(2, *flags, "--dp", "2", "--balance", *extra, "--save", str(tmp_path / f"{tag}.npz"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = dict(np.load(tmp_path / f"{tag}.npz"))
        assert max(float(np.max(np.abs(got[k] - serial[k]))) for k in serial) < 1e-12, tag
