"""minickpt against Orbax and against the machine's own limits, measured in one run.

``python -m benchmarks`` (or ``bash benchmarks/run.sh``) runs every figure, prints a table of
ratios with the goals they are held to, and writes ``bench-out/results.json`` (every sample),
``bench-out/table.md`` and ``bench-out/scaling.png``. ``--smoke`` runs the same code at tiny
sizes in well under a minute: it checks the harness, not the library's speed.

Everything is timed the same way: medians of several repetitions, interleaved (minickpt,
Orbax, limit, minickpt, ...) so that a slow moment of a shared machine hits every contender
alike, with untimed set-up (fresh directories, cache eviction) between repetitions.
"""
