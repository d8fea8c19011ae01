"""A framework's checkpointer on a DistributedOptimizer: plain
``torch.distributed.checkpoint.save({"optim": opt.state_dict(), ...})`` by every rank, then
``dcp.load`` into the optimizer's own ``state_dict()`` and ``opt.load_state_dict`` (what
Accelerate's and torchtitan's checkpointers do), with no bitscom.checkpointing call.

DCP keeps one copy of a key that every rank saves. The compressor state differs per rank, so it
sits under per-rank keys (``bitscom.rank<r>``): the run resumes bitwise. Where a checkpointer
does keep one rank's state for all (torch.save on the main process only, or a state dict in the
layout before per-rank keys), every rank raises the same error naming bitscom.checkpointing."""

import os

import pytest
import torch
import torch.nn as nn

import bitscom
from distpool import RankError
from helpers import global_batch, make_model, shard

BEFORE, AFTER = 3, 3


def _build(seed, momentum=0.9):
    model = make_model(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    return model, bitscom.DistributedOptimizer(
        opt, model.named_parameters(), fusion_threshold_mb=0.0005,          # several buckets
        compression=bitscom.compressors.LowBit(bitwidth=2, error_feedback=True))


def _step(model, opt, step, rank, world):
    x, y = global_batch(step, world)
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
    opt.zero_grad()


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _residuals(opt):
    return torch.cat([st.state_dict()["residual"]["residual"] for st in opt.compressor_states])


def _template(rank, world, momentum=0.9, warm=True):
    """Another replica (another init) to load into. DCP loads torch's optimizer state into the
    template's tensors, so momentum buffers need one step first (``warm``: torch's rule, as
    torch's get_optimizer_state_dict does with a zero step); bitscom's per-rank entry is one
    opaque value and loads into a fresh optimizer's template too."""
    model, opt = _build(seed=123, momentum=momentum)
    if warm:
        _step(model, opt, 99, rank, world)
    return model, opt


def _resume_plainly(rank, world, path, momentum):
    import torch.distributed.checkpoint as dcp
    model, opt = _build(seed=0, momentum=momentum)
    for s in range(BEFORE):
        _step(model, opt, s, rank, world)
    saved_residuals = _residuals(opt)
    dcp.save({"optim": opt.state_dict(), "model": model.state_dict()}, checkpoint_id=path)
    for s in range(BEFORE, BEFORE + AFTER):
        _step(model, opt, s, rank, world)
    uninterrupted = _params(model)
    opt.close()

    model2, opt2 = _template(rank, world, momentum, warm=bool(momentum))
    state = {"optim": opt2.state_dict(), "model": model2.state_dict()}
    dcp.load(state, checkpoint_id=path)
    opt2.load_state_dict(state["optim"])
    loaded_residuals = _residuals(opt2)
    for s in range(BEFORE, BEFORE + AFTER):
        _step(model2, opt2, s, rank, world)
    resumed = _params(model2)
    opt2.close()
    keys = sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    return saved_residuals, loaded_residuals, uninterrupted, resumed, keys


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["fresh-template", "momentum-template-after-a-step"])
def test_plain_dcp_of_state_dict_resumes_bitwise(pools, tmp_path, momentum):
    out = pools.run(2, _resume_plainly, str(tmp_path / "ckpt"), momentum)
    (saved0, loaded0, run0, resumed0, keys), (saved1, loaded1, run1, resumed1, _) = out
    assert not torch.equal(saved0, saved1), "the residuals should differ per rank (else the test is moot)"
    assert torch.equal(loaded0, saved0) and torch.equal(loaded1, saved1), "a rank resumed another's residual"
    assert torch.equal(resumed0, run0) and torch.equal(resumed1, run1), "resume differs from the uninterrupted run"
    assert torch.equal(run0, run1)
    for r in (0, 1):                      # both ranks' compressor state is in the checkpoint
        assert f"optim.bitscom.rank{r}" in keys, keys


def _shared_layout(envelope, rank):
    """The envelope as it was before per-rank keys: this rank's state beside ``rank``."""
    own = bitscom.face.own_entry(envelope, rank)
    return {k: v for k, v in own.items() if not (k.startswith("rank") and k[4:].isdigit())}


def _one_copy_for_all(rank, world, path, how):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    model, opt = _build(seed=0)
    for s in range(BEFORE):
        _step(model, opt, s, rank, world)
    if how == "main-process-file":                       # torch.save by rank 0 only
        if rank == 0:
            torch.save({"optim": opt.state_dict()}, path)
        dist.barrier()
        loaded = torch.load(path, weights_only=True)["optim"]
    else:                                                # DCP, per-rank state under shared keys
        sd = opt.state_dict()
        sd["bitscom"] = _shared_layout(sd["bitscom"], rank)
        dcp.save({"optim": sd}, checkpoint_id=path)
        model2, opt2 = _template(rank, world)
        template = opt2.state_dict()
        template["bitscom"] = _shared_layout(template["bitscom"], rank)
        state = {"optim": template}
        dcp.load(state, checkpoint_id=path)
        opt2.close()
        loaded = state["optim"]
    opt.load_state_dict(loaded)
    try:
        _step(model, opt, BEFORE, rank, world)
        return None
    except RuntimeError as err:
        return str(err)
    finally:
        opt.close()


@pytest.mark.parametrize("how", ["main-process-file", "dcp-shared-keys"])
def test_one_ranks_state_for_every_rank_is_one_error_naming_bitscom_checkpointing(pools, tmp_path, how):
    path = str(tmp_path / ("opt.pt" if how == "main-process-file" else "ckpt"))
    errors = pools.run(2, _one_copy_for_all, path, how)
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "was given the checkpoint of rank" in errors[0], errors[0]
    assert "bitscom.checkpointing.save(opt, path)" in errors[0], errors[0]
    assert "torch.distributed.checkpoint.save" in errors[0] and "torch.save on the main process" in errors[0]


def test_a_missing_rank_in_a_plain_dcp_checkpoint_is_dcps_error_on_that_rank(pools, tmp_path):
    """A 2-rank checkpoint loaded on 4 ranks: ranks 2 and 3 find no entry of their own (DCP's
    error, raised inside dcp.load before bitscom sees anything); bitscom.checkpointing.load is
    the path for another world size (docs/checkpoints.md)."""
    path = str(tmp_path / "ckpt")
    pools.run(2, _save_only, path)
    with pytest.raises(RankError, match=r"optim\.bitscom\.rank[23]"):
        pools.run(4, _load_only, path)


def _save_only(rank, world, path):
    import torch.distributed.checkpoint as dcp
    model, opt = _build(seed=0)
    _step(model, opt, 0, rank, world)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    opt.close()


def _load_only(rank, world, path):
    import torch.distributed.checkpoint as dcp
    model, opt = _template(rank, world)
    try:
        dcp.load({"optim": opt.state_dict()}, checkpoint_id=path)
    finally:
        opt.close()
    assert os.path.isdir(path)
