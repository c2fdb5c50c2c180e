"""The per-device caches (ridge/utils/device_cache.py, ridge/layers/tuning.py): a corrupt file or
one of another version is measured again with a warning naming it, not a crash; two processes
adding entries to one table through `measured` keep both's; a reader never sees half a file."""
import json
import logging
import multiprocessing as mp

from ridge.layers.tuning import measured
from ridge.utils.device_cache import cached, read_json, write_json

VERSION = 3


def test_a_corrupt_or_foreign_cache_file_is_measured_again_with_a_warning(tmp_path, caplog):
    path = str(tmp_path / "kind" / "table.json")
    calls = []

    def measure():
        calls.append(1)
        return {"x": len(calls)}

    assert cached(path, VERSION, measure) == {"x": 1}                # nothing cached: measured, quietly
    assert cached(path, VERSION, measure) == {"x": 1} and len(calls) == 1
    assert not caplog.records
    for bad, why in (('{"version": 3, "payl', "unreadable"), ('[1, 2]', "not a ridge cache"),
                     (json.dumps({"version": 2, "payload": {"x": 0}}), "of version 2")):
        with open(path, "w") as f:
            f.write(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ridge"):
            got = cached(path, VERSION, measure)
        assert got == {"x": len(calls)} and read_json(path, VERSION) == got     # measured again, written back
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert path in caplog.text and why in caplog.text and "measuring again" in caplog.text


def _add_buckets(path: str, buckets: list[int], start) -> None:
    start.wait()
    for b in buckets:
        measured(path, VERSION, (b,), lambda missing: {str(m): {"us": m} for m in missing})


def _read_many(path: str, start, seen) -> None:
    start.wait()
    for _ in range(400):
        payload = read_json(path, VERSION)       # None only before the first write: never a torn file
        if payload is not None:
            seen.value += 1


def test_two_processes_sharing_the_cache_directory_keep_both_tables_entries(tmp_path):
    path = str(tmp_path / "int4" / "shared.json")
    write_json(path, VERSION, {})
    ctx = mp.get_context("spawn")
    start, seen = ctx.Barrier(3), ctx.Value("i", 0)
    procs = [ctx.Process(target=_add_buckets, args=(path, list(range(i, 120, 2)), start)) for i in (0, 1)]
    procs.append(ctx.Process(target=_read_many, args=(path, start, seen)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert seen.value == 400                                       # every read found a whole file
    assert sorted(map(int, read_json(path, VERSION))) == list(range(120))
    assert not [f for f in (tmp_path / "int4").iterdir() if f.name.endswith(".tmp")]
