"""Run by tests/test_horovod_face.py under RANK=0 WORLD_SIZE=2 and no bitscom.init(): every
Horovod-face call (and acpsgd.allreduce) must raise at once instead of returning this rank's own value. Prints one
JSON object {call: "ErrorType: message" or "returned"} and whether torch.distributed stayed
uninitialized."""
import json

import torch
import torch.distributed as dist

import acpsgd
import bitscom

x = torch.ones(2, 3)
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
CALLS = {
    "allreduce": lambda: bitscom.allreduce(x),
    "allreduce_": lambda: bitscom.allreduce_(x.clone()),
    "allreduce_async": lambda: bitscom.allreduce_async(x),
    "allreduce_async_": lambda: bitscom.allreduce_async_(x.clone()),
    "grouped_allreduce": lambda: bitscom.grouped_allreduce([x]),
    "allgather": lambda: bitscom.allgather(x),
    "allgather_async": lambda: bitscom.allgather_async(x),
    "broadcast": lambda: bitscom.broadcast(x, root_rank=0),
    "broadcast_": lambda: bitscom.broadcast_(x.clone(), root_rank=0),
    "broadcast_async": lambda: bitscom.broadcast_async(x, root_rank=0),
    "broadcast_async_": lambda: bitscom.broadcast_async_(x.clone(), root_rank=0),
    "alltoall": lambda: bitscom.alltoall(x),
    "alltoall_async": lambda: bitscom.alltoall_async(x),
    "allgather_object": lambda: bitscom.allgather_object({"a": 1}),
    "barrier": lambda: bitscom.barrier(),
    "broadcast_parameters": lambda: bitscom.broadcast_parameters(model.state_dict(), root_rank=0),
    "broadcast_optimizer_state": lambda: bitscom.broadcast_optimizer_state(opt, root_rank=0),
    "broadcast_object": lambda: bitscom.broadcast_object({"a": 1}, root_rank=0),
    "acpsgd.allreduce": lambda: acpsgd.allreduce(x.clone()),      # the ACP-SGD face too
}
out = {}
for name, call in CALLS.items():
    try:
        call()
        out[name] = "returned"
    except Exception as err:  # noqa: BLE001 — reported to the test
        out[name] = f"{type(err).__name__}: {err}"
print("RESULT " + json.dumps({"calls": out, "initialized": dist.is_initialized()}), flush=True)
