"""ridge's benchmarks: scripts run from the repository root as `python3 benchmarks/<folder>/<name>.py`
(each puts the root on sys.path, so they import `ridge` and `benchmarks.timing` alike); benchmarks/run.py
runs them on a GPU."""
