"""The drop-in's side-channel methods have FastDeploy's signatures."""

import inspect

from fastdeploy_sync.fastdeploy import EngineWorkerQueue

# FastDeploy's methods beyond the task path and their positional parameters
FASTDEPLOY_METHODS = {
    "num_cache_infos": [], "put_cache_info": ["cache_info"], "get_cache_info": [],
    "put_finished_req": ["send_cache_result"], "get_finished_req": [],
    "put_finished_add_cache_task_req": ["req_ids"], "get_finished_add_cache_task_req": [],
    "put_disaggregated_tasks": ["item"], "get_disaggregated_tasks": [],
    "disaggregate_queue_empty": [], "put_connect_rdma_task": ["connect_rdma_task"],
    "get_connect_rdma_task": [],
    "put_connect_rdma_task_response": ["connect_rdma_task_response"],
    "get_connect_rdma_task_response": [], "get_prefill_instances": [],
}


def _positional(fn):
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "self"]


def test_signatures():
    for method, params in FASTDEPLOY_METHODS.items():
        assert _positional(getattr(EngineWorkerQueue, method)) == params, method
    for method in ("to_tensor", "to_numpy"):  # class methods, as FastDeploy's
        assert isinstance(inspect.getattr_static(EngineWorkerQueue, method), classmethod)
        assert _positional(getattr(EngineWorkerQueue, method)) == ["tasks"]
