"""The directory ``fastdeploy_sync.fastdeploy.install()`` and ``fastdeploy-sync run`` put first on
``PYTHONPATH``: its ``sitecustomize`` makes every Python process started with it install the
drop-in too, and ``fdsync_spawn_check`` (standard library only, also imported as a top-level
module there) reports the Python children that would start without it."""
