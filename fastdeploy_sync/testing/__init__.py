"""What the tests and the scripts (soaks, floods, benchmarks) share, as ``numpy.testing`` is
numpy's: process bodies and helpers that start real engines, ranks and peers. The library
never imports this package. Modules:

``processes``  report and collect what child processes say; the consistency rank and checks
``peers``      floods from inside the trust boundary, a dying producer, a held GIL, peak memory
``fd_loops``   FastDeploy's worker loop shapes (task path only) over the drop-in

The tests' own fixtures stay in ``tests/conftest.py``.
"""
