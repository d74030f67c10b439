"""`edge-batcher bench` and its load generators, one concept per module.

* ``command.py``: the subcommand's arguments, and what it prints or writes.
* ``local_bench.py``: one model's phases, in the order they run.
* ``engine_phases.py``: the engine alone: its raw ceiling and a minimal asyncio batcher.
* ``in_process.py``: load through the whole runtime in this process, closed or open loop.
* ``open_loop.py``: the open loop: --rate, Poisson arrivals and what they saw.
* ``url_bench.py``: --url: the transport phases against a running daemon, on its models.
* ``daemon_phases.py``: a daemon subprocess of its own, for the transport phases.
* ``transport_phases.py``: any daemon loaded over its URL or through its MQTT broker.
* ``figures.py``: latency percentiles and the median run, shared by the phases.
* ``report.py``: the results as tables, and as a picture (--plot).
* ``csv_table.py``: --csv: one row per phase and model.
* ``mqtt_load.py``: a closed-loop MQTT 5 request/response load generator.
* ``http_load.py``: a light closed-loop HTTP/1.1 load generator (tools/bench_compare.py).

Import the submodules directly: this package imports nothing itself.
"""
