"""The directory ``fastdeploy_sync.fastdeploy.install()`` puts on ``PYTHONPATH``: its
``sitecustomize`` makes every Python process started afterwards install the drop-in too."""
