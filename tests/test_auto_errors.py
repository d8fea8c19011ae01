"""compression="auto" refuses bad settings at construction, and an error at its decision step
reaches every rank (issue 32, defect 6: ``Auto(link="fast")`` was accepted, then rank 0 alone
raised a TypeError at the decision and rank 1 saw only a dead peer)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

import bitscom
from bitscom.compressors import get
from bitscom.cost import Auto, Link


@pytest.mark.parametrize("bad", ["fast", 5, 1e-3, (0.0, 1e-9)])
def test_a_link_that_is_not_a_Link_is_refused_naming_it(bad):
    with pytest.raises(TypeError, match=rf"Auto link must be None .* or a bitscom.cost.Link.*got {re.escape(repr(bad))}"):
        Auto(link=bad)
    with pytest.raises(TypeError, match="link"):
        get("auto", link=bad)


def test_every_other_setting_is_checked_at_construction():
    with pytest.raises(TypeError, match="codec_seconds .* got 3"):
        Auto(codec_seconds=3)
    with pytest.raises(ValueError, match="candidates .* got 'fp16'"):
        Auto(candidates="fp16")
    with pytest.raises(ValueError, match="probe_steps must be an int >= 2, got True"):
        Auto(probe_steps=True)
    assert Auto(candidates=[get("none"), get("fp16")]).candidates == (get("none"), get("fp16"))


@dataclass(frozen=True)
class _BrokenLink(Link):
    """A Link whose time cannot be computed: the decision on rank 0 fails."""

    def seconds(self, nbytes, messages=1.0):
        raise ZeroDivisionError("broken link")


def _decide_with(rank, world, failure):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if failure == "rank0 decision":
        comp = Auto(link=_BrokenLink(0.0, 1e-6), codec_seconds=lambda c, l, w: 0.0)
    else:                                     # the codec timing fails on the last rank only
        def codec(c, l, w):
            if rank == world - 1:
                raise OSError("timer broke")
            return 0.0
        comp = Auto(link=Link(0.0, 1e-6), codec_seconds=codec)
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       compression=comp)    # one bucket: one decision in flight
    error = None
    try:
        for step in range(comp.probe_steps + 1):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as err:
        error = str(err) + " | " + repr(err.__cause__)
    finally:
        opt.close()
    probe = torch.ones(1)
    torch.distributed.all_reduce(probe)     # the group is left clean: the same collectives ran
    return error if probe.item() == world else f"group left unclean: {probe.item()}"


@pytest.mark.parametrize("failure", ["rank0 decision", "one rank's codec timing"])
def test_an_error_at_the_decision_step_is_raised_on_every_rank(pools, failure):
    errors = pools.run(2, _decide_with, failure, timeout=60)
    assert all(e is not None and "compression='auto' could not decide bucket" in e for e in errors), errors
    if failure == "rank0 decision":
        assert "this rank: ZeroDivisionError('broken link')" in errors[0]
        assert "group rank 0" in errors[1]
    else:
        assert "this rank: OSError('timer broke')" in errors[1]
        assert "another rank" in errors[0]
