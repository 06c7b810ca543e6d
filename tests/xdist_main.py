"""The `__main__` file of a pytest-xdist worker (see `conftest._private_worker_tmpdir`): deliberately empty.

execnet runs a worker's code with `python -c`, so its `__main__` has neither `__spec__` nor `__file__`; pyspark
reads that as "running doctests" and calls `sys.exit(0)` when `pyspark.sql.connect` is imported (as
great-expectations does). Naming this file as the worker's `__main__` avoids that; a `spawn` child process
re-runs it as its main module, which does nothing.
"""
