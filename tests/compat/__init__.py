"""Compatibility suite: Horovod-, DDP-hook- and ACP-SGD-style usage of bitscom (issue 11)."""
