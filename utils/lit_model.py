"""The course's TransformerLM as a Lightning module: the same network, loss and optimizer as the
plain scripts, with Lightning doing the distribution.

Only train/Lit_training.py imports this file, so the plain-PyTorch scripts run without Lightning
installed. It lives with the Lightning step's other helpers (utils/lit_data.py,
utils/lit_checkpoints.py), not in model/, which holds the network alone and knows nothing of how
it is trained. Nor does this file know how the network is split: the training script passes the
sharding function (`parallelize`) in.
"""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F

from model.transformer import ModelConfig, TransformerLM
from utils.data import IGNORE_INDEX


class LitTransformerLM(L.LightningModule):
    """TransformerLM + cross-entropy + AdamW, with the logged losses exact under DDP and FSDP2.

    parallelize(model, device_mesh), if given, shards the network when Lightning's
    ModelParallelStrategy calls `configure_model` (for FSDP2: `fully_shard` per block, then the root).
    """

    def __init__(self, cfg: ModelConfig, lr: float = 1e-3, weight_decay: float = 0.1,
                 parallelize: Callable | None = None):
        super().__init__()
        # Plain values only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters({"model_config": cfg.to_dict(), "lr": lr,
                                   "weight_decay": weight_decay})
        self.lr, self.weight_decay = lr, weight_decay
        # Built here from the current torch seed: every rank gets the weights the plain script gets.
        self.model = TransformerLM(cfg)
        self.parallelize = parallelize
        self._parallelized = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def configure_model(self) -> None:
        # Lightning calls this in every fit/validate/test, once its processes and device mesh exist;
        # shard only the first time.
        if self.parallelize is not None and not self._parallelized:
            self.parallelize(self.model, self.device_mesh)
            self._parallelized = True

    def configure_optimizers(self):
        # The plain scripts' optimizer. Under FSDP2 it is created after sharding, on the shards.
        # fused: one kernel updates all parameters on a GPU
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay,
                                 fused=self.device.type == "cuda")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        # sync_dist: the logged value is the mean over ranks (the DDP lesson's all_reduce_mean, TODO 7).
        self.log("train/loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self._log_eval_loss(batch, "val")

    def test_step(self, batch, batch_idx):
        self._log_eval_loss(batch, "test")

    def _log_eval_loss(self, batch, split: str) -> None:
        x, y = batch
        logits = self(x)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                   ignore_index=IGNORE_INDEX)
        tokens = (y != IGNORE_INDEX).sum()  # padding samples have no targets
        # As in TODO 8 of the DDP lesson: add up loss sums and token counts over the steps and
        # (sync_dist) over the ranks, then divide once at the end of the epoch: the single-GPU loss.
        # Logging the batch's mean loss instead would average per-rank means; and its
        # batch_size-weighted mean is not exact either (Lightning 2.6 truncates the summed
        # batch sizes to an integer when it averages them over ranks). float64: long sums.
        self.log(f"{split}/loss_sum", loss_sum.double(), reduce_fx="sum", sync_dist=True,
                 on_step=False, on_epoch=True, logger=False)
        self.log(f"{split}/tokens", tokens.double(), reduce_fx="sum", sync_dist=True,
                 on_step=False, on_epoch=True, logger=False)

    def on_validation_epoch_end(self) -> None:
        self._log_epoch_loss("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch_loss("test")

    def _log_epoch_loss(self, split: str) -> None:
        # Lightning has reduced the epoch's sums (over steps and ranks) before this hook runs.
        sums = self.trainer.callback_metrics
        loss = sums[f"{split}/loss_sum"] / sums[f"{split}/tokens"]
        # The same number on every rank already; sync_dist (a mean of equal values) changes nothing.
        # Perplexity is exp(mean loss), not the mean of per-batch perplexities.
        self.log_dict({f"{split}/loss": loss, f"{split}/ppl": torch.exp(loss.clamp(max=50.0))},
                      sync_dist=True)
