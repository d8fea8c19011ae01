"""Benchmark models with random init and fake data, for scripts/perf.py.

CNNs (resnet50, resnet152, vgg16) come from torchvision when it imports, else from the
definitions below, which reproduce torchvision's architectures layer for layer (same
parameter names and counts: 25,557,032 / 60,192,808 / 138,357,544), so the benchmark does
not depend on a torchvision build that matches the installed torch. Transformers
(bert_base, bert_large, gpt2) are built from ``transformers`` configs: random weights, no
download. ``tiny`` (an MLP) and ``bert_tiny`` are for quick modes and tests.

``build(name, batch_size, seq_len)`` returns a :class:`Workload`: the model, a function that
makes one fake batch, and one that computes the loss of a batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- CNNs (torchvision-compatible) ------------------------------------------------------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


class ResNet(nn.Module):
    def __init__(self, layers, num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], 2)
        self.layer3 = self._make_layer(256, layers[2], 2)
        self.layer4 = self._make_layer(512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes, blocks, stride=1):
        down = None
        if stride != 1 or self.inplanes != planes * 4:
            down = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride, bias=False),
                                 nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, down)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class VGG16(nn.Module):
    CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]

    def __init__(self, num_classes=1000):
        super().__init__()
        layers, c = [], 3
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _cnn(name):
    try:
        import torchvision.models as tvm   # a torchvision that fits the installed torch
        return getattr(tvm, name)(weights=None), "torchvision"
    except Exception:   # absent, or a build for another torch (its C++ ops fail to load)
        pass
    own = {"resnet50": lambda: ResNet([3, 4, 6, 3]), "resnet152": lambda: ResNet([3, 8, 36, 3]),
           "vgg16": VGG16}
    return own[name](), "bitscom scripts/models.py"


# ---- workloads ---------------------------------------------------------------------------------
@dataclass
class Workload:
    model: nn.Module
    make_batch: Callable[[torch.device], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    samples: int                 # samples per batch (per rank)
    source: str                  # where the model definition came from

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def _image_workload(model, bs, source, size=224, classes=1000):
    def make_batch(dev):
        return (torch.randn(bs, 3, size, size, device=dev), torch.randint(0, classes, (bs,), device=dev))
    return Workload(model, make_batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), bs, source)


def _bert(cfg_kwargs, bs, seq_len):
    from transformers import BertConfig, BertForPreTraining
    cfg = BertConfig(**cfg_kwargs)
    model = BertForPreTraining(cfg)

    def make_batch(dev):
        ids = torch.randint(0, cfg.vocab_size, (bs, seq_len), device=dev)
        labels = torch.full_like(ids, -100)
        masked = torch.rand(bs, seq_len, device=dev) < 0.15
        labels[masked] = ids[masked]
        return ids, labels, torch.randint(0, 2, (bs,), device=dev)

    def loss(m, b):
        return m(input_ids=b[0], labels=b[1], next_sentence_label=b[2]).loss
    return Workload(model, make_batch, loss, bs, "transformers BertForPreTraining (random init)")


def _gpt2(cfg_kwargs, bs, seq_len):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(**cfg_kwargs)
    model = GPT2LMHeadModel(cfg)

    def make_batch(dev):
        return (torch.randint(0, cfg.vocab_size, (bs, seq_len), device=dev),)
    return Workload(model, make_batch, lambda m, b: m(input_ids=b[0], labels=b[0]).loss, bs,
                    "transformers GPT2LMHeadModel (random init)")


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 512), nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _tiny(bs):
    def make_batch(dev):
        return torch.randn(bs, 784, device=dev), torch.randint(0, 10, (bs,), device=dev)
    return Workload(TinyMLP(), make_batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), bs, "MLP 784-512-512-10")


BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
BERT_TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)

def _cnn_workload(name):
    def build_cnn(bs, seq_len):
        model, source = _cnn(name)
        return _image_workload(model, bs, source)
    return build_cnn


MODELS = {
    "tiny": lambda bs, L: _tiny(bs),
    "resnet50": _cnn_workload("resnet50"),
    "resnet152": _cnn_workload("resnet152"),
    "vgg16": _cnn_workload("vgg16"),
    "bert_tiny": lambda bs, L: _bert(BERT_TINY, bs, L),
    "bert_base": lambda bs, L: _bert({}, bs, L),
    "bert_large": lambda bs, L: _bert(BERT_LARGE, bs, L),
    "gpt2": lambda bs, L: _gpt2({}, bs, L),
}


def build(name: str, batch_size: int, seq_len: int = 128) -> Workload:
    """The workload ``name`` (see :data:`MODELS`) with ``batch_size`` samples per batch."""
    if name not in MODELS:
        raise ValueError(f"unknown dnn {name!r}; choose one of {', '.join(MODELS)}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return MODELS[name](batch_size, seq_len)
