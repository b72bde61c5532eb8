"""Commands around a run: the machine report (`machine_report`), metric plots (`plot`) and the
inference throughput benchmark (`throughput`).

May import: every package but benchmark.
"""
