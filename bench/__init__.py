"""ragcache benchmarks and accuracy harness: `python -m bench --help`.

One module per benchmark (ttft, throughput, lower_bound, accuracy); squad.py holds the data, report.py writes
tables, JSON and PNG plots under bench/results/. kernels.py and store_io.py are standalone scripts.
"""
