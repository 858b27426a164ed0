"""TaskQueue's arguments, refused before anything is made."""

import pytest

from fastdeploy_sync import TaskQueue

pytestmark = pytest.mark.usefixtures("loopback_tcp")


@pytest.mark.parametrize("bad", [dict(tp_size=0), dict(max_inflight=0), dict(name="a/b"),
                                 dict(name=""), dict(dp_id=-1)])
def test_bad_arguments(name, bad):
    kwargs = dict(name=name, tp_size=1)
    kwargs.update(bad)
    with pytest.raises(ValueError):
        TaskQueue(kwargs.pop("name"), kwargs.pop("tp_size"), **kwargs)
