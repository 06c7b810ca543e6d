"""Engine-neutral building blocks: numpy/pyarrow kernels over column batches.

Every engine (embedded, Spark, Beam) calls these same kernels; an engine adapter
only moves batches between them.
"""
