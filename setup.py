from setuptools import find_packages, setup

setup(
    name="fastdeploy_sync",
    version="0.1.0",
    description="Engine -> tensor-parallel worker task sync off the worker's critical path "
                "(background prefetch, shared-memory TP barrier, ZeroMQ transport)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fastdeploy_sync", "fastdeploy_sync.*"]),
    python_requires=">=3.9",
    install_requires=[
        "pyzmq>=25",
        "numpy>=1.22",
        "posix_ipc>=1.1",
        "xxhash>=3.0",  # payload checksum (xxh3_64), fastdeploy_sync/wire/codec.py
    ],
    extras_require={
        # paddlepaddle (CPU build) for the cross-node coordinator's tests; mkdocs so that
        # tests/integration/test_docs.py can build the documentation site (a broken link fails CI)
        # pytest-xdist: .ci/run and README run the suite three tests at a time
        "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3", "paddlepaddle>=2.6",
                 "mkdocs>=1.6", "mkdocs-material>=9.5", "prometheus_client>=0.17",
                 "tqdm>=4.60", "matplotlib>=3.5"],
        # fastdeploy-sync profile: its progress bar and --plot (it runs without them)
        "profile": ["tqdm>=4.60", "matplotlib>=3.5"],
        "paddle": ["paddlepaddle>=2.6"],
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5"],
        # fastdeploy_sync.metrics: a Prometheus collector over TaskQueue.stats()
        "metrics": ["prometheus_client>=0.17"],
    },
    entry_points={"console_scripts": ["fastdeploy-sync=fastdeploy_sync.cli:main"]},
)
