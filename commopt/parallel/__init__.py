"""Data parallelism over device meshes."""

from commopt.parallel._data_parallel import DataParallel, data_parallel

__all__ = ["DataParallel", "data_parallel"]
