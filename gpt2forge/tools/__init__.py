"""Commands around a run: the machine report (`machine_report`), metric plots (`plot`) and the
inference throughput benchmark (`inference`, behind `inference_gpt2.py`).

May import: every package but benchmark_runner.
"""
