"""`edge-batcher bench` and its load generators, one concept per module.

* ``command.py``: the subcommand: its arguments, the phases it runs in order, the results.
* ``report.py``: the results as two tables, and as a picture (--plot).
* ``mqtt_load.py``: a closed-loop MQTT 5 request/response load generator.
* ``http_load.py``: a light closed-loop HTTP/1.1 load generator (tools/bench_compare.py).

Import the submodules directly: this package imports nothing itself.
"""
