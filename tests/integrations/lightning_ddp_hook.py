"""Lightning + bitscom's DDP comm hook: `python lightning_ddp_hook.py` (Lightning starts the
second process itself), or under torchrun / SLURM."""
import hashlib

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy

import bitscom


class BitscomCommHook(L.Callback):
    """Registers a bitscom DDP comm hook on the DDP model Lightning built. Lightning 2.6 only
    registers DDPStrategy(ddp_comm_hook=...) on CUDA, and building the hook needs the process
    group that Trainer.fit() starts, so the callback does it once fit has wrapped the model."""

    def __init__(self, compression):
        self.compression, self.state = compression, None

    def on_fit_start(self, trainer, pl_module):
        bitscom.init()                                    # adopts Lightning's process group
        self.state, hook = bitscom.ddp_comm_hook(self.compression)
        trainer.strategy.model.register_comm_hook(self.state, hook)   # the DDP wrapper

    def on_fit_end(self, trainer, pl_module):
        self.stats = self.state.comm_stats()              # step_*: the last iteration's, this rank
        self.state.close()


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    hook = BitscomCommHook(bitscom.compressors.PowerSGD(rank=2, start_iter=0))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), max_epochs=1,
                        callbacks=[hook], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    full_loss = lambda: nn.functional.mse_loss(model.net(data.tensors[0]), data.tensors[1]).item()
    before = full_loss()
    trainer.fit(model, loader)
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print(f"RESULT rank={trainer.global_rank} loss={before:.4f}->{full_loss():.4f} "
          f"sent={hook.stats['step_bytes_sent']} "
          f"fp32={hook.stats['step_dense_bytes']} ratio={hook.stats['compression_ratio']:.2f} "
          f"params={digest}", flush=True)
